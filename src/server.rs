//! The running server as the module meets it at load: which server it is, the options the
//! module declares to it, and the commands the module needs from it by name.

use crate::call::CallReply;
use redis_module::{raw, Context, RedisError};
use std::ffi::c_int;

/// Valkey's `VALKEYMODULE_OPTIONS_HANDLE_ATOMIC_SLOT_MIGRATION` (Valkey 9.0+), not in the
/// Redis header this crate binds. Redis numbers its own options, so it is set on Valkey only.
const VALKEY_HANDLE_ATOMIC_SLOT_MIGRATION: c_int = 1 << 5;

/// The running server as the module identifies it at load: name (from `INFO server`) and
/// version (`RedisModule_GetServerVersion`, `0x00MMmmpp`).
#[derive(Debug)]
pub(crate) struct ServerId {
    name: Option<String>,
    version: Option<i32>,
}

impl ServerId {
    /// Reads the name and version of the running server.
    pub(crate) fn read(ctx: &Context) -> ServerId {
        let version = api!(RedisModule_GetServerVersion)
            .ok()
            // SAFETY: no arguments; present since Redis 6.0.9.
            .map(|f| unsafe { f() });
        ServerId {
            name: info_server_name(ctx),
            version,
        }
    }

    /// Whether the server has atomic slot migration and refuses it to a module that has not
    /// declared it handles it: Valkey 9.0 and later.
    fn has_atomic_slot_migration(&self) -> bool {
        self.is(atomic_slot_migration)
    }

    /// Whether the module knows this server's object header (name and version both).
    pub(crate) fn known_header(&self) -> bool {
        self.is(crate::layout::known_header)
    }

    /// `test` of the name and version; false where either is unknown.
    fn is(&self, test: fn(&str, i32) -> bool) -> bool {
        match (&self.name, self.version) {
            (Some(name), Some(version)) => test(name, version),
            _ => false,
        }
    }
}

impl std::fmt::Display for ServerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.name.as_deref().unwrap_or("unknown server");
        match self.version.map(crate::layout::version_parts) {
            Some((major, minor, patch)) => write!(f, "{name} {major}.{minor}.{patch}"),
            None => write!(f, "{name} (version unknown)"),
        }
    }
}

/// The server's name from `INFO server`, or `None` if it cannot be read.
fn info_server_name(ctx: &Context) -> Option<String> {
    let (Ok(get_info), Ok(field), Ok(free_info)) = (
        api!(RedisModule_GetServerInfo),
        api!(RedisModule_ServerInfoGetFieldC),
        api!(RedisModule_FreeServerInfo),
    ) else {
        return None;
    };
    // SAFETY: live context, literal section name; freed below.
    let data = unsafe { get_info(ctx.ctx, c"server".as_ptr()) };
    if data.is_null() {
        return None;
    }
    let text = |name: &std::ffi::CStr| -> Option<String> {
        // SAFETY: live info data; the returned C string lives as long as `data`.
        let p = unsafe { field(data, name.as_ptr()) };
        // SAFETY: non-null pointers from ServerInfoGetFieldC are NUL-terminated.
        (!p.is_null()).then(|| {
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        })
    };
    let server_name = text(c"server_name");
    let redis_version = text(c"redis_version");
    let name = crate::layout::server_name(server_name.as_deref(), redis_version.as_deref())
        .map(str::to_owned);
    // SAFETY: from GetServerInfo with a live context, freed once.
    unsafe { free_info(ctx.ctx, data) };
    name
}

/// Declares the module's options, called first from `OnLoad`:
/// - a key opened for writing is signalled as modified only when `Bucket::write` says so
///   (`REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED`, see `storage::Bucket`);
/// - asynchronous replica loading (`repl-diskless-load swapdb`, where a replica serves reads
///   while it loads) is handled: the module keeps no state about the keyspace and its
///   commands are writes, which a replica refuses anyway. Without it a replica with the module
///   loaded will not load disklessly at all;
/// - on Valkey 9+, atomic slot migration is handled: the module keeps nothing per slot, and a
///   bucket is a string key the migration carries like any other, its writes propagated as
///   `SET`. Without it the server refuses `CLUSTER MIGRATESLOTS` while the module is loaded.
pub(crate) fn declare_options(ctx: &Context, server: &ServerId) -> Result<(), RedisError> {
    let set_options = api!(RedisModule_SetModuleOptions)?;
    // Fail at load, not on the first write, on a server without it.
    api!(RedisModule_SignalModifiedKey)?;
    let mut options = (raw::REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED
        | raw::REDISMODULE_OPTIONS_HANDLE_REPL_ASYNC_LOAD) as c_int;
    if server.has_atomic_slot_migration() {
        options |= VALKEY_HANDLE_ATOMIC_SLOT_MIGRATION;
    }
    // SAFETY: OnLoad context; documented option bits of this server.
    unsafe { set_options(ctx.ctx, options) };
    Ok(())
}

/// Fails the load where a command the module uses by name is missing (`rename-command`):
/// writes replicate as `SET` and, where the server keeps the value, are made with `SET` and
/// read with `GET`. Found missing only on the first check, a write could be made and then not
/// replicated, leaving replicas behind the primary.
pub(crate) fn require_commands(ctx: &Context) -> Result<(), RedisError> {
    for (name, command) in [("SET", c"SET"), ("GET", c"GET")] {
        if !command_exists(ctx, command)? {
            return Err(RedisError::String(format!(
                "the server has no {name} command (rename-command?): the module writes and \
                 replicates buckets with SET and reads them with GET"
            )));
        }
    }
    Ok(())
}

/// Whether the server has `command`, asked without running it: called with no arguments,
/// the server looks the command up (`ENOENT` if missing) and then refuses the arity
/// (`EINVAL`). Not `COMMAND INFO`, which a hardened server may have renamed itself.
fn command_exists(ctx: &Context, command: &std::ffi::CStr) -> Result<bool, RedisError> {
    let call = api!(RedisModule_Call)?;
    // SAFETY: OnLoad context; a literal command, no arguments.
    let reply = unsafe { call(ctx.ctx, command.as_ptr(), c"".as_ptr()) };
    // ENOENT reads as NotFound; read before anything else can set errno.
    let missing = std::io::Error::last_os_error().kind() == std::io::ErrorKind::NotFound;
    // Not expected (no command runs without its arguments), but freed if it comes.
    drop(CallReply::new(reply));
    Ok(!(reply.is_null() && missing))
}

/// Whether `name` at `version` (`0x00MMmmpp`) is a server with atomic slot migration that
/// asks modules to declare it: Valkey 9.0 and later.
fn atomic_slot_migration(name: &str, version: i32) -> bool {
    let (major, _, _) = crate::layout::version_parts(version);
    name == "valkey" && major >= 9
}

#[cfg(test)]
mod tests {
    use super::atomic_slot_migration;

    #[test]
    fn atomic_slot_migration_is_declared_on_valkey_9_only() {
        let v = |major: u8, minor: u8| i32::from_be_bytes([0, major, minor, 0]);
        assert!(atomic_slot_migration("valkey", v(9, 0)));
        assert!(atomic_slot_migration("valkey", v(10, 1)));
        assert!(!atomic_slot_migration("valkey", v(8, 1)));
        // The bit is Valkey's: never set on Redis, whatever the version.
        assert!(!atomic_slot_migration("redis", v(8, 4)));
        assert!(!atomic_slot_migration("redis", v(9, 0)));
    }
}
