#!/usr/bin/env bash
# Builds PgBouncer 1.24.1 (Debian trixie's version; the machine's own
# package is bookworm's 1.18) from Debian's source tarball, checked by its
# SHA-256, into /var/tmp/watermill-idempotency, and prints the binary's path. The pooler
# tests run against it too (IDEMPOTENCY_PGBOUNCER_NEWER): 1.21+ tracks
# protocol-level prepared statements (max_prepared_statements), which
# changes what a transaction pooler does to pgx's named statements.
# Needs a C compiler, make, pkg-config and libevent-dev, libssl-dev
# (.ci/run installs them). Idempotent: a built binary is reused.
set -euo pipefail
version=1.24.1
sha256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
url=http://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_${version}.orig.tar.gz
# Under /var/tmp: the tests run the pooler as postgres, who cannot enter /root.
prefix=/var/tmp/watermill-idempotency/pgbouncer-$version
bin=$prefix/bin/pgbouncer
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS -m 120 -o "$work/src.tar.gz" "$url"
echo "$sha256  $work/src.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/src.tar.gz" -C "$work"
(
  cd "$work/pgbouncer-$version"
  ./configure --prefix="$prefix" --without-cares --without-systemd --without-pam --without-ldap >"$work/build.log" 2>&1 &&
    make -j2 >>"$work/build.log" 2>&1 && make install >>"$work/build.log" 2>&1
) || { tail -30 "$work/build.log" >&2; exit 1; }
echo "$bin"
