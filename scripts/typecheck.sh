#!/bin/sh
# mypy over the package as it is installed (pubcomp.sync from sync/, ...): the
# editable install is an import hook mypy cannot follow, so a tree of symlinks
# under .typecheck/ gives it the installed layout.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
tree="$root/.typecheck"
rm -rf "$tree"
mkdir -p "$tree/pubcomp"
for f in "$root"/pubcomp/*.py; do ln -s "$f" "$tree/pubcomp/"; done
for part in sync sensors gateway pipeline; do ln -s "$root/$part" "$tree/pubcomp/$part"; done
cd "$tree"
exec "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$tree/.mypy_cache" -p pubcomp
