#!/usr/bin/env bash
# Apply megatron-adacc's patches (patches/series) to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh [--check] [--force] MEGATRON_DIR
#
# Order of work: (1) MEGATRON_DIR is a Megatron-LM git checkout; (2) its HEAD is a commit the patches were
# checked against (patches/supported-commits.txt); (3) a dry run (`git apply --check`) of every patch that is
# not applied yet; (4) only if all of them would apply, apply them. Running it again is a no-op: a patch
# whose reverse applies cleanly is reported as already applied.
#
#   --check  stop after the dry run (exit 0 if the patches apply or are already applied)
#   --force  accept a commit that is not in patches/supported-commits.txt (the dry run still guards)
#
# Exit codes: 0 applied or already applied, 2 usage, 3 not a Megatron-LM git checkout, 4 unknown commit,
# 5 a patch does not apply (conflict), 6 uncommitted changes would be mixed with the patch.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCH_DIR="${ADACC_PATCH_DIR:-$HERE/patches}"
SERIES="$PATCH_DIR/series"
COMMITS="$PATCH_DIR/supported-commits.txt"

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
say() { printf 'apply_patches: %s\n' "$*"; }
fail() {
    local code="$1"
    shift
    {
        printf 'error: %s\n' "$1"
        shift
        [ $# -eq 0 ] || printf '%s\n' "$@" | sed 's/^/  /'
    } | sed 's/^/apply_patches: /' >&2
    exit "$code"
}

check_only=0
force=0
target=""
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check_only=1 ;;
        --force) force=1 ;;
        -h | --help) usage ;;
        -*) printf 'apply_patches: unknown option %s\n' "$1" >&2; usage ;;
        *)
            [ -z "$target" ] || { printf 'apply_patches: one MEGATRON_DIR only\n' >&2; usage; }
            target="$1"
            ;;
    esac
    shift
done
[ -n "$target" ] || usage
[ -f "$SERIES" ] || fail 2 "no patch series at $SERIES"

# (1) a Megatron-LM git checkout
[ -d "$target" ] || fail 3 "$target is not a directory"
target="$(cd "$target" && pwd)"
[ -f "$target/pretrain_gpt.py" ] && [ -d "$target/megatron" ] ||
    fail 3 "$target does not look like a Megatron-LM checkout (no pretrain_gpt.py and megatron/)." \
        "Pass the root of a clone of https://github.com/NVIDIA/Megatron-LM."
git -C "$target" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
    fail 3 "$target is not a git checkout, so its commit cannot be verified." \
        "Use a clone of https://github.com/NVIDIA/Megatron-LM (a release tarball has no history)."

# (2) the commit
head="$(git -C "$target" rev-parse HEAD)"
label="$(awk -v c="$head" '!/^#/ && $1 == c { $1 = ""; sub(/^ /, ""); print; exit }' "$COMMITS")"
if [ -n "$label" ]; then
    say "Megatron-LM at $head ($label): supported"
else
    pinned="$(awk '!/^#/ && NF { print $1; exit }' "$COMMITS")"
    supported="$(awk '!/^#/ && NF { printf "  %s\n", $0 }' "$COMMITS")"
    if [ "$force" = 1 ]; then
        say "warning: $head is not a commit the patches were checked against; --force given, trying anyway"
    else
        fail 4 "unknown Megatron-LM commit $head." \
            "The patches were checked against:" "$supported" \
            "Check out the pinned one (git -C $target checkout $pinned), or pass --force to try this commit" \
            "(the dry run below still refuses a patch that does not apply)."
    fi
fi

# (3) dry run of every patch: already applied, applies, or conflicts
to_apply=()
while read -r name; do
    case "$name" in '' | '#'*) continue ;; esac
    patch="$PATCH_DIR/$name"
    [ -f "$patch" ] || fail 2 "patches/series names $name, which is not in $PATCH_DIR"
    if git -C "$target" apply --check "$patch" 2>/dev/null; then
        files="$(git -C "$target" apply --numstat "$patch" | awk '{ print $3 }')"
        # shellcheck disable=SC2086  # word splitting of the file list is intended
        dirty="$(git -C "$target" status --porcelain -- $files)"
        [ -z "$dirty" ] || fail 6 "$name touches files with uncommitted changes:" "$dirty" \
            "Commit or discard them first (git -C $target diff), so that the patched tree is reproducible."
        say "dry run: $name applies cleanly"
        to_apply+=("$patch")
    elif git -C "$target" apply --reverse --check "$patch" 2>/dev/null; then
        say "already applied: $name (nothing to do)"
    else
        details="$(git -C "$target" apply --check "$patch" 2>&1 || true)"
        fail 5 "$name does not apply to $target (conflict):" "$details" \
            "Either the files were edited by hand (git -C $target status; git -C $target diff) or this commit" \
            "changed the lines the patch touches. Restore the files (git -C $target checkout -- <file>) or use" \
            "a supported commit."
    fi
done <"$SERIES"

if [ "${#to_apply[@]}" -eq 0 ]; then
    say "all patches already applied to $target"
    exit 0
fi
if [ "$check_only" = 1 ]; then
    say "--check: ${#to_apply[@]} patch(es) would apply; nothing changed"
    exit 0
fi

# (4) apply; the dry run passed for every patch, so a failure here is unexpected
for patch in "${to_apply[@]}"; do
    git -C "$target" apply "$patch" || fail 5 "applying $(basename "$patch") failed after a clean dry run"
    say "applied: $(basename "$patch")"
done
say "done: $target is patched. Install megatron-adacc in the same Python (pip install -e $HERE) and run"
say "  python $target/pretrain_gpt.py ... --adacc-policy auto"
