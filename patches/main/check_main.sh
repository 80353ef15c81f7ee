#!/usr/bin/env bash
# Check that patches/main/*.diff still fit the torchtitan commit recorded in BASE.md.
#
#   TORCHTITAN_REPO=/path/to/torchtitan.git patches/main/check_main.sh
#
# TORCHTITAN_REPO: a torchtitan git directory (bare or not), default
# /work/.mirror/pytorch+torchtitan/repo. No network: only `git` on that directory.
# 1. The blob id of every file the diffs touch, at the commit, must be the one in
#    BASE.md (between the "blobs:begin" and "blobs:end" markers); files the diffs
#    create must be absent there.
# 2. Those files alone are extracted into a temp dir, and `patch --dry-run -p1` must
#    succeed for every diff on its own; then all diffs are applied in order (for real,
#    in a second copy) and each must apply cleanly.
# Exits non-zero on any failure. Without the repository it prints
# "skipped: no torchtitan repository at ..." and exits 0.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=${TORCHTITAN_REPO:-/work/.mirror/pytorch+torchtitan/repo}
base_md=$here/BASE.md

if ! git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    echo "skipped: no torchtitan repository at $repo"
    exit 0
fi

commit=$(sed -n 's/^Commit: `\([0-9a-f]\{40\}\)`.*/\1/p' "$base_md" | head -n 1)
if [ -z "$commit" ]; then
    echo "FAIL: no 'Commit: \`<40 hex>\`' line in $base_md" >&2
    exit 1
fi
if ! git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "FAIL: commit $commit (from BASE.md) is not in $repo" >&2
    exit 1
fi
echo "torchtitan repository: $repo"
echo "commit: $commit ($(git -C "$repo" log -1 --format='%ci %s' "$commit"))"

status=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. Blob ids.
blobs=$(sed -n '/<!-- blobs:begin -->/,/<!-- blobs:end -->/p' "$base_md" \
    | grep -E '^([0-9a-f]{40}|absent) ' || true)
if [ -z "$blobs" ]; then
    echo "FAIL: no blob list between the blobs:begin/blobs:end markers in $base_md" >&2
    exit 1
fi
mkdir -p "$tmp/tree"
while read -r want path; do
    if [ "$want" = absent ]; then
        if git -C "$repo" cat-file -e "$commit:$path" 2>/dev/null; then
            echo "FAIL  $path exists at the commit (the diffs create it)"
            status=1
        else
            echo "ok    $path absent (created by a diff)"
        fi
        continue
    fi
    have=$(git -C "$repo" rev-parse --verify --quiet "$commit:$path" || echo missing)
    if [ "$have" = "$want" ]; then
        echo "ok    $path $have"
        mkdir -p "$tmp/tree/$(dirname "$path")"
        git -C "$repo" cat-file blob "$have" >"$tmp/tree/$path"
    else
        echo "FAIL  $path: blob $have at the commit, BASE.md says $want"
        status=1
    fi
done <<<"$blobs"

# Every file a diff touches must be in the list.
shopt -s nullglob
diffs=("$here"/*.diff)
if [ ${#diffs[@]} -eq 0 ]; then
    echo "FAIL: no .diff in $here" >&2
    exit 1
fi
for d in "${diffs[@]}"; do
    for path in $(sed -n 's#^+++ b/\([^[:space:]]*\).*#\1#p' "$d"); do
        if ! grep -qE "^([0-9a-f]{40}|absent) $path\$" <<<"$blobs"; then
            echo "FAIL  $(basename "$d") touches $path, which BASE.md does not list"
            status=1
        fi
    done
done

# 2. Each diff alone, then all in order.
for d in "${diffs[@]}"; do
    if out=$(cd "$tmp/tree" && patch --dry-run --batch -p1 <"$d" 2>&1) \
        && ! grep -qiE 'offset|fuzz|reject|failed' <<<"$out"; then
        echo "ok    alone:    $(basename "$d")"
    else
        echo "FAIL  alone:    $(basename "$d") (does not apply cleanly)"
        sed 's/^/      /' <<<"$out"
        status=1
    fi
done
cp -R "$tmp/tree" "$tmp/all"
for d in "${diffs[@]}"; do
    if out=$(cd "$tmp/all" && patch --batch -p1 <"$d" 2>&1) \
        && ! grep -qiE 'offset|fuzz|reject|failed' <<<"$out"; then
        echo "ok    in order: $(basename "$d")"
    else
        echo "FAIL  in order: $(basename "$d") (does not apply cleanly)"
        sed 's/^/      /' <<<"$out"
        status=1
    fi
done

if [ $status -eq 0 ]; then
    echo "all ${#diffs[@]} diffs apply cleanly to $commit"
else
    echo "check_main.sh: FAILED" >&2
fi
exit $status
