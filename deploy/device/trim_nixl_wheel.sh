#!/usr/bin/env bash
# A NIXL wheel small enough to carry to the device machine (64 MiB per call, tree included): nixl-cu13 1.5.1 for
# CPython 3.12 is 56 MB; what a P/D KV transfer over UCX needs of it is ~14 MB compressed. This downloads the wheel
# and the `nixl` meta package, keeps the Python API, libnixl and the UCX (and POSIX) plugins with the shared
# libraries they load (their ELF NEEDED closure, plus every UCX transport module), drops the other plugins (GDS,
# GPUNETIO, object stores, ...), the nixl_ep extension (3 x 31 MB) and the scripts, rewrites RECORD and zips it
# back as a wheel. Usage (on this machine, with network access to PyPI):
#   bash deploy/device/trim_nixl_wheel.sh [OUTDIR=.whl-nixl]
# then carry OUTDIR and install both wheels with `pip install --no-deps --target ...` on the device.
set -euo pipefail
OUT="$(realpath -m "${1:-.whl-nixl}")"
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$work" nixl-cu13==1.5.1 nixl==1.5.1 >/dev/null
cp "$work"/nixl-1.5.1-*.whl "$OUT"/
wheel="$(ls "$work"/nixl_cu13-1.5.1-*.whl)"
mkdir "$work/x"
(cd "$work/x" && unzip -q "$wheel")
cd "$work/x"
rm -rf nixl_ep_cu13 nixl_cu13.scripts
for d in .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl; do
    [[ -d "$d" ]] && find "$d" -type f ! -name 'libplugin_UCX.so' ! -name 'libplugin_POSIX.so' -delete
done
"$PY" - <<'PY'
import base64, csv, hashlib, os, re, subprocess

files = {}
for d, _, fs in os.walk("."):
    for f in fs:
        if ".so" in f:
            files[f] = os.path.join(d, f)


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"NEEDED.*\[(.*)\]", out)


keep_roots = [p for f, p in files.items() if f.startswith(("_bindings", "_utils", "libplugin_", "libnixl"))]
keep_roots += [p for p in files.values() if "/ucx/" in p and "perftest" not in p]
seen, stack = set(), list(keep_roots)
while stack:
    p = stack.pop()
    if p not in seen:
        seen.add(p)
        stack += [files[n] for n in needed(p) if n in files]
for p in files.values():
    if p not in seen:
        os.remove(p)
record = next(p for p in os.listdir(".") if p.endswith(".dist-info")) + "/RECORD"
rows = []
for d, _, fs in os.walk("."):
    for f in fs:
        p = os.path.join(d, f)[2:]
        if p != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(open(p, "rb").read()).digest()).rstrip(b"=").decode()
            rows.append((p, "sha256=" + digest, os.path.getsize(p)))
with open(record, "w", newline="") as fh:
    writer = csv.writer(fh)
    writer.writerows(rows)
    writer.writerow((record, "", ""))
PY
zip -q -9 -r "$OUT/$(basename "$wheel")" .
ls -la "$OUT"
