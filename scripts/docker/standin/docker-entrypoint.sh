#!/bin/sh
# docker-entrypoint.sh of the local stand-in server images (scripts/docker/build makes them
# only where the public redis / valkey images cannot be pulled). It does what the official
# images' entrypoints do: a first argument that is an option or a .conf file means "the
# server with these arguments"; started as root, the server drops to its own user; umask 0077.
set -e

server=redis-server
if command -v valkey-server >/dev/null 2>&1; then server=valkey-server; fi
user=${server%-server}

if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
	set -- "$server" "$@"
fi

if [ "$1" = "$server" ] && [ "$(id -u)" = 0 ]; then
	find . \! -user "$user" -exec chown "$user" '{}' +
	exec setpriv --reuid="$user" --regid="$user" --clear-groups "$0" "$@"
fi

# The official images compile the server with protected mode off, so a published port
# answers without a password; Debian's server has it on, so turn it off here (after a
# config file, before the caller's arguments, which may turn it back on).
if [ "$1" = "$server" ]; then
	shift
	if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
		conf=$1
		shift
		set -- "$server" "$conf" --protected-mode no "$@"
	else
		set -- "$server" --protected-mode no "$@"
	fi
fi

um="$(umask)"
if [ "$um" = '0022' ]; then
	umask 0077
fi

exec "$@"
