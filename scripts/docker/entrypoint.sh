#!/bin/sh
# Entrypoint of the redis-ratelimit images: whatever the container is started with, the
# server loads the module; then the base image's own entrypoint takes over (a first argument
# that is an option or a .conf file still means "the server with these arguments").
#
#   docker run IMAGE                          -> redis-server --loadmodule MODULE
#   docker run IMAGE --maxmemory 100mb        -> redis-server --maxmemory 100mb --loadmodule MODULE
#   docker run IMAGE /etc/my.conf --port 7000 -> redis-server /etc/my.conf --port 7000 --loadmodule MODULE
#   docker run IMAGE redis-cli ...            -> unchanged
set -e
module=/usr/local/lib/redis-ratelimit/libredis_ratelimit.so

server=redis-server
if command -v valkey-server >/dev/null 2>&1; then server=valkey-server; fi

if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
	set -- "$server" "$@"
fi
if [ "$1" = redis-server ] || [ "$1" = valkey-server ]; then
	# Appended: the server takes a config file only as its first argument.
	set -- "$@" --loadmodule "$module"
fi
exec docker-entrypoint.sh "$@"
