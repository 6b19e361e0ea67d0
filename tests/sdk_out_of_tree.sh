#!/usr/bin/env bash
# Installs this build of mt into a temporary prefix, builds the SDK's template model plugin out
# of tree against it, and checks that the installed mt finds and uses it via MT_PLUGIN_PATH.
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src/sdk/template" -B "$work/tiny" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/tiny" -j2 >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
mt=$work/prefix/bin/mt
export MT_PLUGIN_PATH=$work/tiny
fail() { echo "FAIL: $*"; exit 1; }
out=$("$mt" plugins) || fail "mt plugins exited $?"
echo "$out"
abi=$("$mt" --version | sed -nE 's/.*plugin ABI ([0-9]+).*/\1/p')
[ -n "$abi" ] || fail "mt --version names no plugin ABI"
grep -Eq "^model +tiny +1\.0\.0 +$abi +.*libmt_model_tiny\.so" <<<"$out" ||
  fail "mt plugins does not list the tiny plugin (ABI $abi)"
out=$("$mt" models) || fail "mt models exited $?"
echo "$out"
grep -Eq '^tiny-template +tiny +[0-9.]+K' <<<"$out" || fail "mt models does not size tiny-template"
# The plugin_dirs key finds the plugin and its models/ as MT_PLUGIN_PATH does (before: the
# plugin loaded, but --model=tiny-template was unknown).
out=$(MT_PLUGIN_PATH= "$mt" config --model=tiny-template "plugin_dirs=[$work/tiny]") ||
  fail "mt config with plugin_dirs exited $?: $out"
grep -q '^decoder_block: tiny' <<<"$out" || fail "plugin_dirs did not find the template's model"
out=$("$mt" config --model=tiny-template base_emb_dim=48) || fail "mt config exited $?"
grep -q '^decoder_block: tiny' <<<"$out" || fail "mt config did not resolve the family"
grep -q '^base_emb_dim: 48' <<<"$out" || fail "mt config did not apply the override"
# The family's own key (its config_schema()) is shown with its origin, can be set like any key,
# is checked against its [>0] by the loader and against the family's validate().
out=$("$mt" config --model=tiny-template --origins) || fail "mt config --origins exited $?"
grep -Eq "^tiny_residual_scale: 1\.0 +# model family 'tiny' config_schema\(\):1$" <<<"$out" ||
  fail "mt config does not show the family's key tiny_residual_scale with its origin"
out=$("$mt" config --model=tiny-template tiny_residual_scale=0.5) || fail "mt config exited $?"
grep -q '^tiny_residual_scale: 0.5' <<<"$out" || fail "tiny_residual_scale=0.5 was not applied"
refused() {  # refused <what the message must hold> <mt config arguments...>
  local want=$1 rc=0
  shift
  out=$("$mt" config --model=tiny-template "$@" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "mt config $* exited $rc, not 2: $out"
  grep -q -- "$want" <<<"$out" || fail "mt config $*: the message lacks '$want': $out"
}
refused 'is unstable' tiny_residual_scale=100
refused 'out of range' tiny_residual_scale=-1
# The template does not tie its head: logits_via_embedding is refused as a key the family does
# not use (before: the core marked it read, and the run kept an untied lm_head silently).
rc=0
out=$("$mt" run --model=tiny-template logits_via_embedding=true steps=1 \
  base_output_directory="$work/tied" 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "mt run logits_via_embedding=true exited $rc, not 2: $out"
grep -q 'does not use logits_via_embedding=true' <<<"$out" ||
  fail "mt run logits_via_embedding=true: the message does not name the key: $out"
# Another family's keys are unknown, naming the family that decides.
refused 'decoder_block=llama' decoder_block=llama tiny_residual_scale=2
grep -Eq "^data +counting +1\.0\.0 +$abi +.*libmt_data_counting\.so" <<<"$("$mt" plugins)" ||
  fail "mt plugins does not list the counting data plugin"
# The installed mt trains on the out-of-tree data source, chosen by config alone.
out=$("$mt" run --model=tiny-template dataset_type=counting steps=3 eval_interval=-1 \
  enable_checkpointing=false max_target_length=16 per_device_batch_size=2 \
  tokenizer_path= base_output_directory="$work/out") || fail "mt run with dataset_type=counting exited $?"
grep -q 'data=counting' <<<"$out" || fail "the run did not use the counting data source"
grep -q 'mt run: done. 3 steps' <<<"$out" || fail "the run did not finish"
# The data plugin's own key (add_dataset_keys): typed and checked when dataset_type names it,
# unknown otherwise.
grep -q '^counting_start: 5 ' <<<"$("$mt" config --model=tiny-template dataset_type=counting \
  counting_start=5 --origins)" || fail "mt config does not show the data plugin's key"
refused 'counting_start=-1' dataset_type=counting counting_start=-1
refused 'counting_start' dataset_type=synthetic counting_start=5
# The shipped text data source builds out of tree too: it needs the SDK's headers only
# (mt/json.h, mt/io.h), not the core's private ones.
mkdir -p "$work/text/src/text"
cp -r "$src/plugins/data/text/text_source.cpp" "$work/text/src/text/"
cp -r "$src/plugins/data/common" "$work/text/src/"
cat >"$work/text/src/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.20)
project(mt_text_out_of_tree CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(mt REQUIRED)
find_package(Threads REQUIRED)
set(MT_PLUGIN_OUTPUT_DIR ${CMAKE_BINARY_DIR})
mt_add_plugin(mt_data_text SOURCES text/text_source.cpp LIBS Threads::Threads)
CMAKE
cmake -S "$work/text/src" -B "$work/text/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >"$work/text.log" 2>&1 &&
  cmake --build "$work/text/build" -j2 >>"$work/text.log" 2>&1 ||
  { cat "$work/text.log"; fail "the text data plugin does not build out of tree"; }
[ -f "$work/text/build/libmt_data_text.so" ] || fail "no libmt_data_text.so built out of tree"
echo "out-of-tree plugins OK"
