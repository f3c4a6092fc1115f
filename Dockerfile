# A Redis or Valkey image with the redis-ratelimit module (RL.CHECK, RL.CHECKALL) loaded.
#
#   docker build -t redis-ratelimit .                                # Redis 7.2
#   docker build --build-arg SERVER=valkey -t redis-ratelimit:valkey .   # Valkey 8.0
#   docker run --rm -p 6379:6379 redis-ratelimit                     # + any server arguments:
#   docker run --rm -p 6379:6379 redis-ratelimit --maxmemory 100mb --appendonly yes
#   redis-cli RL.CHECK user:42 1.6666666666666667 20 1
#
# The module is loaded at start whatever arguments are given (scripts/docker/entrypoint.sh),
# the server runs as its own non-root user, and a healthcheck pings it on whichever port it
# listens on (scripts/docker/healthcheck.sh). Builder and server images are Debian bookworm
# based, so the module links against the same glibc.
#
# The base images are build arguments only so that scripts/docker/build can point them at
# local stand-ins where no registry is reachable; a normal build uses the public ones.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG REDIS_IMAGE=redis:7.2-bookworm
ARG VALKEY_IMAGE=valkey/valkey:8.0-bookworm
ARG SERVER=redis

FROM ${RUST_IMAGE} AS build
# bindgen (used by redis-module) needs libclang.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libclang-dev clang \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# CARGO_OFFLINE=1: build from the crates `cargo vendor` put in ./vendor (scripts/docker/build
# does this where crates.io cannot be reached from a container). BUILD_JOBS limits cargo's
# parallelism (default: all cores).
ARG CARGO_OFFLINE=0
ARG BUILD_JOBS=
RUN set -eu; \
    if [ "$CARGO_OFFLINE" = 1 ]; then \
      mkdir -p .cargo; \
      printf '[source.crates-io]\nreplace-with = "vendored"\n[source.vendored]\ndirectory = "vendor"\n' \
        > .cargo/config.toml; \
      offline=--offline; \
    else \
      offline=; \
    fi; \
    cargo build --release --locked $offline ${BUILD_JOBS:+--jobs "$BUILD_JOBS"} -p redis-ratelimit; \
    strip --strip-debug -o /libredis_ratelimit.so target/release/libredis_ratelimit.so

FROM ${REDIS_IMAGE} AS redis
ARG REDIS_IMAGE
LABEL org.opencontainers.image.base.name="${REDIS_IMAGE}"
COPY --from=build /libredis_ratelimit.so /usr/local/lib/redis-ratelimit/
COPY scripts/docker/entrypoint.sh /usr/local/bin/ratelimit-entrypoint.sh
COPY scripts/docker/healthcheck.sh /usr/local/bin/ratelimit-healthcheck.sh
USER redis
HEALTHCHECK --interval=5s --timeout=3s --retries=3 CMD ["ratelimit-healthcheck.sh"]
ENTRYPOINT ["ratelimit-entrypoint.sh"]
CMD ["redis-server"]

FROM ${VALKEY_IMAGE} AS valkey
ARG VALKEY_IMAGE
LABEL org.opencontainers.image.base.name="${VALKEY_IMAGE}"
COPY --from=build /libredis_ratelimit.so /usr/local/lib/redis-ratelimit/
COPY scripts/docker/entrypoint.sh /usr/local/bin/ratelimit-entrypoint.sh
COPY scripts/docker/healthcheck.sh /usr/local/bin/ratelimit-healthcheck.sh
USER valkey
HEALTHCHECK --interval=5s --timeout=3s --retries=3 CMD ["ratelimit-healthcheck.sh"]
ENTRYPOINT ["ratelimit-entrypoint.sh"]
CMD ["valkey-server"]

FROM ${SERVER}
LABEL org.opencontainers.image.title="redis-ratelimit" \
      org.opencontainers.image.description="Redis / Valkey with the RL.CHECK rate-limit module loaded"
