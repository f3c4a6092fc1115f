//! A reply of `RedisModule_Call`, freed on drop, and the few ways the module reads one.

use redis_module::{raw, RedisError};
use std::ptr::NonNull;

/// A `RedisModule_Call` reply, freed on drop.
pub(crate) struct CallReply(NonNull<raw::RedisModuleCallReply>);

impl CallReply {
    /// Wraps what `RedisModule_Call` returned: null means the server refused the call.
    pub(crate) fn new(reply: *mut raw::RedisModuleCallReply) -> Result<Self, RedisError> {
        NonNull::new(reply)
            .map(Self)
            .ok_or(RedisError::Str("ERR the server refused the module's call"))
    }

    /// The reply's type, a `REDISMODULE_REPLY_*` value.
    pub(crate) fn kind(&self) -> Result<isize, RedisError> {
        let reply_type = api!(RedisModule_CallReplyType)?;
        // SAFETY: live reply.
        Ok(unsafe { reply_type(self.0.as_ptr()) } as isize)
    }

    /// The reply's bytes if it is a string, `None` if it is null; an error otherwise.
    pub(crate) fn string(&self) -> Result<Option<&[u8]>, RedisError> {
        let string_ptr = api!(RedisModule_CallReplyStringPtr)?;
        match self.kind()? {
            raw::REDISMODULE_REPLY_STRING => {
                let mut len = 0;
                // SAFETY: live string reply; the bytes live as long as the reply.
                let p = unsafe { string_ptr(self.0.as_ptr(), &mut len) };
                if p.is_null() {
                    return Err(RedisError::Str("ERR could not read the key"));
                }
                // SAFETY: `len` bytes at `p`, borrowed from `self`.
                Ok(Some(unsafe {
                    std::slice::from_raw_parts(p.cast::<u8>(), len)
                }))
            }
            raw::REDISMODULE_REPLY_NULL => Ok(None),
            _ => Err(RedisError::Str(
                "ERR the server answered the module's call with an error",
            )),
        }
    }
}

impl Drop for CallReply {
    fn drop(&mut self) {
        // SAFETY: a reply from RedisModule_Call, freed exactly once, here.
        if let Some(free) = unsafe { raw::RedisModule_FreeCallReply } {
            unsafe { free(self.0.as_ptr()) };
        }
    }
}
