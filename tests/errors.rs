//! Bad input never hurts the server: each gets an `ERR`/`WRONGTYPE` error, nothing is written,
//! and the server keeps answering.

use redis_ratelimit_testkit::*;

/// (arguments, expected substring of the error, case-insensitively)
const BAD: &[(&[&str], &str)] = &[
    (&["RL.CHECK"], "wrong number of arguments"),
    (&["RL.CHECK", "K"], "wrong number of arguments"),
    (&["RL.CHECK", "K", "1"], "wrong number of arguments"),
    (
        &["RL.CHECK", "K", "1", "1", "1", "extra"],
        "wrong number of arguments",
    ),
    (&["RL.CHECK", "K", "abc", "1"], "rate must be a number"),
    (&["RL.CHECK", "K", "", "1"], "rate must be a number"),
    (&["RL.CHECK", "K", "1,5", "1"], "rate must be a number"),
    (&["RL.CHECK", "K", "nan", "1"], "finite"),
    (&["RL.CHECK", "K", "inf", "1"], "finite"),
    (&["RL.CHECK", "K", "-inf", "1"], "finite"),
    (&["RL.CHECK", "K", "0", "1"], "greater than 0"),
    (&["RL.CHECK", "K", "-1", "1"], "greater than 0"),
    (&["RL.CHECK", "K", "1e300", "1"], "at most 10000000"),
    (&["RL.CHECK", "K", "1e-12", "1"], "too long"),
    (&["RL.CHECK", "K", "1", "999999999999"], "too long"),
    (
        &["RL.CHECK", "K", "1", "0"],
        "burst must be an integer >= 1",
    ),
    (
        &["RL.CHECK", "K", "1", "-5"],
        "burst must be an integer >= 1",
    ),
    (
        &["RL.CHECK", "K", "1", "1.5"],
        "burst must be an integer >= 1",
    ),
    (
        &["RL.CHECK", "K", "1", "abc"],
        "burst must be an integer >= 1",
    ),
    (
        &["RL.CHECK", "K", "1", "99999999999999999999999"],
        "burst must be an integer >= 1",
    ),
    (
        &["RL.CHECK", "K", "1", "5", "-1"],
        "cost must be an integer >= 0",
    ),
    (
        &["RL.CHECK", "K", "1", "5", "2.5"],
        "cost must be an integer >= 0",
    ),
    (
        &["RL.CHECK", "K", "1", "5", "x"],
        "cost must be an integer >= 0",
    ),
    (&["RL.CHECKALL"], "wrong number of arguments"),
    (&["RL.CHECKALL", "K", "1", "1"], "wrong number of arguments"),
    (
        &["RL.CHECKALL", "K", "1", "1", "1", "K2"],
        "wrong number of arguments",
    ),
    // One limit (the path shared with RL.CHECK): the same errors.
    (&["RL.CHECKALL", "K", "0", "5", "1"], "greater than 0"),
    (&["RL.CHECKALL", "K", "1", "0", "1"], "burst must be"),
    (
        &["RL.CHECKALL", "K", "1", "5", "x"],
        "cost must be an integer >= 0",
    ),
    // The first limit is valid: it must not be taken when the second one is bad.
    (
        &["RL.CHECKALL", "K", "1", "5", "1", "K", "1", "0", "1"],
        "burst must be",
    ),
    (
        &["RL.CHECKALL", "K", "1", "5", "1", "K", "nan", "1", "1"],
        "finite",
    ),
    (&["RL.SETTLE", "K", "1", "5"], "wrong number of arguments"),
    (
        &["RL.SETTLE", "K", "1", "5", "1", "extra"],
        "wrong number of arguments",
    ),
    (&["RL.SETTLE", "K", "x", "5", "1"], "rate must be a number"),
    (&["RL.SETTLE", "K", "0", "5", "1"], "greater than 0"),
    (&["RL.SETTLE", "K", "1", "0", "1"], "burst must be"),
    (
        &["RL.SETTLE", "K", "1", "5", "1.5"],
        "delta must be an integer",
    ),
    (
        &["RL.SETTLE", "K", "1", "5", "x"],
        "delta must be an integer",
    ),
    (
        &["RL.SETTLE", "K", "1", "5", "99999999999999999999"],
        "delta must be an integer",
    ),
    // Debt beyond the format's bounds is refused, not wrapped.
    (
        &["RL.SETTLE", "K", "1", "5", "9223372036854775807"],
        "debt for more than",
    ),
    (
        &["RL.SETTLE", "K", "0.001", "5", "200001"],
        "debt for more than",
    ),
];

#[test]
fn bad_arguments_are_refused_and_write_nothing() {
    for t in targets("badargs") {
        let mut c = t.conn();
        let k = t.key("K");
        for (args, want) in BAD {
            let args: Vec<String> = args
                .iter()
                .map(|a| if *a == "K" { k.clone() } else { a.to_string() })
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let err = expect_err(&mut c, &args);
            // redis-rs reports an `ERR ...` reply as "ResponseError: ...".
            assert!(
                err.contains("ResponseError") && err.to_lowercase().contains(want),
                "{}: {args:?} gave {err:?}, wanted {want:?}",
                t.name
            );
            assert!(!exists(&mut c, &k), "{}: {args:?} wrote the key", t.name);
        }
        let pong: String = redis::cmd("PING").query(&mut c).unwrap();
        assert_eq!(pong, "PONG", "{}", t.name);
    }
}

#[test]
fn keys_that_are_not_buckets_are_refused_untouched() {
    for t in targets("badkeys") {
        let mut c = t.conn();
        let list = t.key("list");
        let _: i64 = redis::cmd("RPUSH")
            .arg(&list)
            .arg("x")
            .query(&mut c)
            .unwrap();
        for cmd in [
            &["RL.CHECK", &list, "1", "1"][..],
            &["RL.CHECKALL", &list, "1", "1", "1"],
            &["RL.SETTLE", &list, "1", "1", "1"],
        ] {
            let err = expect_err(&mut c, cmd);
            assert!(
                err.to_lowercase().contains("wrongtype"),
                "{}: {err}",
                t.name
            );
        }

        // Strings that do not follow the stored format: wrong text, no expiry.
        let cases: &[(&str, &str, bool)] = &[
            ("text", "hello", true),
            ("big", "50000", true),
            ("padded", "0042", true),
            ("negative", "-1", true),
            ("persistent", "42", false),
        ];
        for (name, value, with_ttl) in cases {
            let k = t.key(name);
            let mut set = redis::cmd("SET");
            set.arg(&k).arg(*value);
            if *with_ttl {
                set.arg("PX").arg(600_000);
            }
            let _: () = set.query(&mut c).unwrap();
            let before: Option<Vec<u8>> = redis::cmd("DUMP").arg(&k).query(&mut c).unwrap();
            let err = expect_err(&mut c, &["RL.CHECK", &k, "1", "1"]);
            assert!(
                err.contains("ResponseError: key is not a rate-limit bucket"),
                "{}: {err}",
                t.name
            );
            // RL.CHECKALL refuses it too, and takes nothing from the good key beside it.
            let good = t.key("good");
            let err = expect_err(
                &mut c,
                &["RL.CHECKALL", &good, "1", "5", "1", &k, "1", "1", "1"],
            );
            assert!(err.contains("not a rate-limit bucket"), "{}: {err}", t.name);
            let err = expect_err(&mut c, &["RL.CHECKALL", &k, "1", "1", "1"]);
            assert!(err.contains("not a rate-limit bucket"), "{}: {err}", t.name);
            let err = expect_err(&mut c, &["RL.SETTLE", &k, "1", "5", "1"]);
            assert!(err.contains("not a rate-limit bucket"), "{}: {err}", t.name);
            assert!(
                !exists(&mut c, &good),
                "{}: {name}: good key written",
                t.name
            );
            let after: Option<Vec<u8>> = redis::cmd("DUMP").arg(&k).query(&mut c).unwrap();
            assert_eq!(before, after, "{}: {name} changed", t.name);
            let pttl = pttl(&mut c, &k);
            assert_eq!(pttl > 0, *with_ttl, "{}: {name} expiry changed", t.name);
        }
    }
}

#[test]
fn binary_and_odd_key_names_work() {
    for t in targets("binkeys") {
        let mut c = t.conn();
        for suffix in ["", "\0nul", "{", "}{x}", "\u{1F600}", " spaced key"] {
            let k = t.key(suffix);
            let r: Reply = redis::cmd("RL.CHECK")
                .arg(k.as_bytes())
                .arg(1)
                .arg(2)
                .query(&mut c)
                .unwrap();
            assert_eq!((r.0, r.1), (1, 1), "{}: {k:?}", t.name);
            assert!(exists(&mut c, &k), "{}: {k:?}", t.name);
        }
    }
}
