# The floors of src/ may only include downwards.
add_test(NAME floors_include_downwards COMMAND ${PROJECT_SOURCE_DIR}/tools/check_floors.sh)
