# The CLI tests run build/bin/metrale: build it first.
if(TARGET metrale AND TARGET metrale_apps_tests)
  add_dependencies(metrale_apps_tests metrale)
endif()
