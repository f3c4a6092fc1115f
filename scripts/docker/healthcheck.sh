#!/bin/sh
# Healthcheck of the redis-ratelimit images: the server answers PING on a TCP port it listens
# on, whichever port it was started with (`--port 7000`, a config file), not only 6379. A
# server that asks for a password first (NOAUTH) is up too; with REDISCLI_AUTH set in the
# container the CLI authenticates itself.
#
# The ports are the listening sockets of the processes this user can read (the server, which
# runs as this user), lowest first: the cluster bus, when there is one, is above the
# server's port. Sockets of other processes (`--network host`) are not tried. Addresses: an
# IPv4 one (as /proc shows it on little-endian hosts), or the IPv6 wildcard; a server bound
# only to a specific IPv6 address, a Unix socket or a TLS port needs its own --health-cmd.
cli=redis-cli
if command -v valkey-cli >/dev/null 2>&1; then cli=valkey-cli; fi

# "ADDRESS PORT" per listening socket of ours: IPv4 wildcard as 127.0.0.1, IPv6 as ::1.
listening() {
  ls -l /proc/[0-9]*/fd/ 2>/dev/null | awk '
    function hex(s,   i, n) {
      n = 0
      for (i = 1; i <= length(s); i++) n = n * 16 + index("0123456789ABCDEF", toupper(substr(s, i, 1))) - 1
      return n
    }
    FILENAME == "-" {
      if (match($0, /socket:\[[0-9]+\]/)) ours[substr($0, RSTART + 8, RLENGTH - 9)] = 1
      next
    }
    FNR > 1 && $4 == "0A" && ($10 in ours) {
      split($2, a, ":")
      if (FILENAME ~ /tcp6$/) {
        if (a[1] != "00000000000000000000000000000000") next
        host = "::1"
      } else if (a[1] == "00000000") {
        host = "127.0.0.1"
      } else {
        host = hex(substr(a[1], 7, 2)) "." hex(substr(a[1], 5, 2)) "." hex(substr(a[1], 3, 2)) "." hex(substr(a[1], 1, 2))
      }
      print hex(a[2]), host
    }' - /proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -n -u
}

listening | {
  while read -r port host; do
    case "$("$cli" -h "$host" -p "$port" ping 2>/dev/null)" in
      PONG | NOAUTH*) exit 0 ;;
    esac
  done
  exit 1
}
