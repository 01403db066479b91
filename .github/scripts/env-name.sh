#!/usr/bin/env bash
# Prints TRAINSTACK_ENV=<name> for $GITHUB_ENV: pr-<N> for a pull request, else the given name, else the
# branch, lower-cased, non [a-z0-9-] replaced by '-', starting with a letter, at most 20 characters
# (infra/config.py's rule for -c env).
set -euo pipefail
pr="${1:-}"; given="${2:-}"; ref="${3:-}"
if [ -n "$pr" ]; then name="pr-$pr"; elif [ -n "$given" ]; then name="$given"; else name="$ref"; fi
name=$(printf '%s' "$name" | tr '[:upper:]' '[:lower:]' | sed -e 's/[^a-z0-9-]/-/g' -e 's/^[^a-z]*//' | cut -c1-20)
[ -n "$name" ] || { echo "cannot derive an environment name from '$pr' '$given' '$ref'" >&2; exit 2; }
echo "TRAINSTACK_ENV=$name"
