# Local stand-in for the public rust:<version>-bookworm image, made by scripts/docker/build only
# where no container registry is reachable: Debian bookworm with the C toolchain the official
# image has, and this machine's own Rust toolchain (copied into the build context as
# `toolchain/`), laid out like the official image (RUSTUP_HOME, CARGO_HOME, cargo in PATH).
FROM debian:bookworm-slim
ARG TOOLCHAIN
LABEL org.opencontainers.image.description="local stand-in made by redis-ratelimit's scripts/docker/build"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
COPY toolchain /usr/local/rustup/toolchains/$TOOLCHAIN
RUN mkdir -p /usr/local/cargo/bin \
 && ln -s /usr/local/rustup/toolchains/$TOOLCHAIN/bin/* /usr/local/cargo/bin/ \
 && rustc --version && cargo --version
