# Builds the module and produces a server image with it loaded.
#
#   docker build -t redis-ratelimit .                          # Redis 7.0
#   docker build --build-arg SERVER=valkey -t valkey-ratelimit .   # Valkey 8
#   docker run --rm -p 6379:6379 redis-ratelimit
#   redis-cli RL.CHECK user:42 1.6666666666666667 20 1
#
# Both server images are Debian bookworm based, like the build stage, so the module links
# against the same glibc.
ARG SERVER=redis

FROM rust:1-bookworm AS build
# bindgen (used by redis-module) needs libclang.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libclang-dev clang \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p redis-ratelimit

FROM redis:7.0-bookworm AS redis
COPY --from=build /src/target/release/libredis_ratelimit.so /usr/local/lib/libredis_ratelimit.so
CMD ["redis-server", "--loadmodule", "/usr/local/lib/libredis_ratelimit.so"]

FROM valkey/valkey:8.0-bookworm AS valkey
COPY --from=build /src/target/release/libredis_ratelimit.so /usr/local/lib/libredis_ratelimit.so
CMD ["valkey-server", "--loadmodule", "/usr/local/lib/libredis_ratelimit.so"]

FROM ${SERVER}
