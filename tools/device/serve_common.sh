# Shared by the serving benchmarks (bench_serve.sh, tier_bench.sh); sourced, not run.
#
# serve_model_args PRESET [extra serve flags...]: sets model_args (the `metrale serve` flags of a
#   random-weight configs/PRESET.json with the Qwen3 tokenizer of TOKENIZER_DIR, default
#   models/default) and tokenizer_args (bench-serve's); both empty for an empty PRESET (the bundled
#   default model). Returns 1 when the tokenizer, git-ignored, was not carried.
# wait_for_server PID OUT_FILE: prints the URL the server announces in OUT_FILE (empty when it died
#   or took more than 5 minutes).
serve_model_args() {
  local preset=$1
  shift
  model_args=()
  tokenizer_args=()
  [[ -z $preset ]] && return 0
  local tokenizer_dir=${TOKENIZER_DIR:-models/default}
  if [[ ! -f $tokenizer_dir/tokenizer.json ]]; then
    echo "$tokenizer_dir/tokenizer.json is missing (carry it: it is git-ignored)"
    return 1
  fi
  model_args=(--config "configs/$preset.json" --random-weights --tokenizer "$tokenizer_dir" "$@")
  tokenizer_args=(--tokenizer "$tokenizer_dir")
}

wait_for_server() {
  local pid=$1 out_file=$2 url=
  for _ in $(seq 1 600); do  # loading and planning a large model takes a while
    url=$(grep -o 'http://[^ ]*' "$out_file" 2>/dev/null | head -1)
    [[ -n $url ]] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "$url"
}
