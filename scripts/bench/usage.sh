# Sourced by the benchmarks before they start anything: `--help` prints the calling
# script's header comment, and any other argument is refused (their settings are
# environment variables), so a mistyped flag never starts a long pinned run.
case "${1-}" in
  "") ;;
  -h | --help)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
    ;;
  *)
    echo "usage: $0 [--help]  (settings are environment variables: see --help)" >&2
    exit 2
    ;;
esac
