#!/usr/bin/env bash
# The install a user gets: builds the main wheel (the default targets' kernels inside) and one kernel
# wheel, installs both into a clean virtual environment (not editable, not from the checkout), and
# from a directory outside the checkout runs `rdnattention info`, the installed generator, and the
# host-emulator tests against that install. Run after scripts/setup.sh (it reuses build/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
OUT="$ROOT/.whl"
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== wheel: rdnattention (the default targets' kernels, from build/)"
RDNATTENTION_WHEEL_BUILD_DIR="$ROOT/build" "$PYTHON" -m pip wheel --no-deps -q -w "$OUT" .
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The kernel wheel at one head_dim, in a build directory of its own: what is tested is that the wheel
# installs and the runtime finds its target, and the narrowed compile is a part of the full one.
echo "== wheel: rdnattention-kernels-gcn4 (head_dim 64)"
"$PYTHON" -m rdnattention_gen.cli package --family gcn4 --head-dims 64 --build-dir "$WORK/kernel-build" --out "$OUT"
ls -l "$OUT"

echo "== clean environment in $WORK"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
MAIN=$(ls "$OUT"/rdnattention-*-py3-none-any.whl)
"$VPY" -m pip install -q "$MAIN[gen]" "$OUT"/rdnattention_kernels_gcn4-*.whl
cp -r tests "$WORK/tests"
cd "$WORK"
export XDG_DATA_HOME="$WORK/data"  # the per-user kernel directory of this test only

# The host emulator's targets (host_f32 too: the tests' host_build reads both) are a compile each, and
# the generator needs no torch: they build while torch and the test tools install. At the head_dims the
# tests below run (--head-dims, as a user builds for one model; the tests read the same narrowing), the
# compile is under a third of theirs (the checkout's tests run the whole build); the tests of another
# head_dim skip.
export RDNATTENTION_TEST_HEAD_DIMS=64
echo "== rdnattention-gen build --user --targets host,host_f32 --head-dims $RDNATTENTION_TEST_HEAD_DIMS (beside the install of torch)"
"$WORK/venv/bin/rdnattention-gen" build --user --targets host,host_f32 --head-dims "$RDNATTENTION_TEST_HEAD_DIMS" \
  > build-user.txt 2>&1 &
USER_BUILD=$!
"$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" pytest pytest-xdist hypothesis numpy
wait "$USER_BUILD" || { cat build-user.txt; exit 1; }
head -1 build-user.txt
tail -1 build-user.txt

echo "== rdnattention info --json"
"$WORK/venv/bin/rdnattention" info --json > info.json
"$VPY" - <<'PY'
import json
info = json.load(open("info.json"))
roots = {r["source"]: r for r in info["kernel_search_path"]}
print("\n".join(f"  {r['path']} ({r['source']}): {', '.join(r['targets']) or '-'}" for r in info["kernel_search_path"]))
assert not any(s == "source checkout" for s in roots), "an installed runtime must not search a checkout"
package = roots["rdnattention package"]["targets"]
assert package == sorted(["gfx1011", "gfx1012", "gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035",
                          "gfx1036", "gfx906"]), package
dist = [r for s, r in roots.items() if s.startswith("distribution rdnattention-kernels-gcn4")]
assert dist and dist[0]["targets"] == ["gfx803"], roots
print("installed kernels found: package", ", ".join(package), "| kernel wheel gfx803")
PY
echo "== rdnattention-gen list (the [gen] extra)"
"$WORK/venv/bin/rdnattention-gen" list --targets gfx1030 > list.txt
head -3 list.txt
"$WORK/venv/bin/rdnattention" info > info.txt
head -8 info.txt
echo "== host-emulator tests against the install"
RDNATTENTION_TEST_INSTALLED=1 "$VPY" -m pytest -q -p no:cacheprovider -n auto --dist loadfile \
  tests/kernels/test_host_kernel.py tests/runtime/test_torch.py
