#!/usr/bin/env bash
# Prints the directories of the go.work workspace's modules, one a line, the
# core (.) first. Used by scripts/test.sh and scripts/check-modules.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
go work edit -json | sed -n 's/.*"DiskPath": "\(.*\)".*/\1/p' | sed 's#^\./##; s#^$#.#' |
  sort | awk '$0 == "." { print; next } { rest[++n] = $0 } END { for (i = 1; i <= n; i++) print rest[i] }'
