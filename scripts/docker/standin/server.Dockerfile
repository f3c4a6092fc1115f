# Local stand-in for the public redis:7.0-bookworm or valkey/valkey:8.0-bookworm image, made by
# scripts/docker/build only where no container registry is reachable. Debian bookworm's own
# server package (redis-server 7.0; valkey-server 8.0 from bookworm-backports), laid out like
# the official image: the server in PATH, its own user, /data as the working directory,
# docker-entrypoint.sh, CMD the server.
FROM debian:bookworm-slim AS base
ARG SERVER=redis
LABEL org.opencontainers.image.description="local stand-in made by redis-ratelimit's scripts/docker/build"
# Services must not start during the build; backports come from the same mirror as the
# image's own apt source (debootstrap wrote it), so no host name is written here.
RUN set -eux; \
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; \
    if [ "$SERVER" = valkey ]; then \
      sed -n 's/^deb \([^ ]*\) bookworm main$/deb \1 bookworm-backports main/p' /etc/apt/sources.list \
        > /etc/apt/sources.list.d/backports.list; \
      grep -q bookworm-backports /etc/apt/sources.list.d/backports.list; \
    fi; \
    apt-get update; \
    if [ "$SERVER" = valkey ]; then \
      apt-get install -y --no-install-recommends -t bookworm-backports valkey-server valkey-tools; \
    else \
      apt-get install -y --no-install-recommends redis-server redis-tools; \
    fi; \
    rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d; \
    mkdir -p /data; chown "$SERVER:$SERVER" /data; \
    "$SERVER-server" --version
COPY docker-entrypoint.sh /usr/local/bin/
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]

# Built with --target redis or --target valkey (CMD cannot take a build argument).
FROM base AS redis
CMD ["redis-server"]

FROM base AS valkey
CMD ["valkey-server"]
