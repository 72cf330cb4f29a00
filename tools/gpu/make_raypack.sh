# Build .raypack/site.tar.xz (git-ignored, ~27 MB): Ray and its pure dependencies for the GPU machine, which has
# no network. Ray's wheel is 79 MB; its Java jars, dashboard client and libraries this tool does not use (rllib,
# data, serve, tune, train, llm) are dropped and its three binaries stripped, so the tarball and the kernel pack
# fit one device call's 64 MiB. tools/gpu/ray_session.sh unpacks it.
#   bash tools/gpu/make_raypack.sh            # RAY_VERSION=2.60.0 by default
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${RAY_VERSION:-2.60.0}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download "ray==$version" --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$work/wheels" -q
pip download click jsonschema msgpack protobuf pyyaml requests filelock packaging --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work/wheels" -q
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf "$work"/site/ray/{jars,dashboard/client,rllib,data,serve,llm,train,tune} "$work"/site/*/tests
strip --strip-unneeded "$work/site/ray/_raylet.so" "$work/site/ray/core/src/ray/gcs/gcs_server" \
    "$work/site/ray/core/src/ray/raylet/raylet"
mkdir -p .raypack
tar cJf .raypack/site.tar.xz -C "$work/site" .
ls -l .raypack/site.tar.xz
