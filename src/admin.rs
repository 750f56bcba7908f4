//! The admin API, on the metrics listener behind its own keys
//! (`admin_keys_file`): each replica's state, and draining one so its engine
//! can be restarted or upgraded without a lost request.
//!
//! - `GET /admin/replicas`: every replica; `GET /admin/replicas/{name}`: one.
//!   Each: name, address, health (`up`, `ejected`, `down`), `drained`,
//!   `key_refused` (its engine refused the router's model-list read),
//!   requests in flight, models (`null`: unknown, any), the pinned working
//!   set's estimate (bytes of prompt), what its engine last reported (with
//!   `engine_load`).
//! - `POST /admin/replicas/{name}/drain`: no request is placed there any
//!   more (continuations pinned there go to their next choice, as when it is
//!   down), but for a Responses API request whose stored response only its
//!   engine holds; requests in flight run to their end: `in_flight` reaches
//!   0. It is still health checked. Draining every replica refuses every
//!   request (503 `no_replica`) and makes `/ready` answer 503.
//! - `POST /admin/replicas/{name}/undrain`: back in service.
//!
//! A drained name stays drained across reloads while the file keeps it,
//! whatever its address.
//! Errors are OpenAI-style JSON: 401 without an accepted key (`Authorization:
//! Bearer`), 404 for an unknown replica or path, 405 for another method.

use http::{header, HeaderValue, Method, Response, StatusCode};
use serde_json::{json, Value};

use crate::auth::{self, ApiKeys};
use crate::metrics::Metrics;
use crate::replicas::{Replica, Replicas};

/// Where the admin API's paths start.
pub const PREFIX: &str = "/admin/";

/// The answer to an admin request.
pub fn answer(
    replicas: &Replicas,
    metrics: &Metrics,
    keys: &ApiKeys,
    method: &Method,
    path: &str,
    authorization: Option<&[u8]>,
) -> Response<Vec<u8>> {
    let accepted = auth::presented(authorization, None).is_some_and(|k| keys.accepts(k));
    if !accepted {
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "the admin API needs an accepted admin key (Authorization: Bearer)",
        );
    }
    let Some(rest) = path
        .strip_prefix("/admin/replicas")
        .filter(|r| r.is_empty() || r.starts_with('/'))
    else {
        return error(StatusCode::NOT_FOUND, "not_found", "no such path");
    };
    let view = replicas.snapshot();
    let (name, action) = match rest.trim_start_matches('/').split_once('/') {
        Some((name, action)) => (name, Some(action)),
        None => (rest.trim_start_matches('/'), None),
    };
    if name.is_empty() {
        if rest.len() > 1 {
            return error(StatusCode::NOT_FOUND, "not_found", "no such path");
        }
        return match *method {
            Method::GET => {
                ok(json!({"replicas": view.iter().map(|r| describe(r)).collect::<Vec<_>>()}))
            }
            _ => not_allowed("GET"),
        };
    }
    let unknown = || {
        error(
            StatusCode::NOT_FOUND,
            "replica_not_found",
            &format!("no replica is named {name}"),
        )
    };
    let Some(replica) = view.iter().find(|r| r.name == name) else {
        return unknown();
    };
    let drain = match (action, method) {
        (None, &Method::GET) => return ok(describe(replica)),
        (None, _) => return not_allowed("GET"),
        (Some("drain"), &Method::POST) => true,
        (Some("undrain"), &Method::POST) => false,
        (Some("drain" | "undrain"), _) => return not_allowed("POST"),
        (Some(_), _) => return error(StatusCode::NOT_FOUND, "not_found", "no such path"),
    };
    // Set by name, under the set's publishing lock: a reload at the same
    // moment keeps it (see `Replicas::set_drained`).
    let Some((replica, changed)) = replicas.set_drained(name, drain) else {
        return unknown();
    };
    if changed {
        metrics.show_drained(&replica.name, drain);
        if drain {
            log::info!(
                "replica {} drained through the admin API ({} requests in flight)",
                replica.name,
                replica.in_flight()
            );
        } else {
            log::info!(
                "replica {} back in service through the admin API",
                replica.name
            );
        }
    }
    ok(describe(&replica))
}

/// A replica as the admin API shows it.
fn describe(r: &Replica) -> Value {
    json!({
        "name": r.name,
        "addr": r.addr.to_string(),
        "health": r.health(),
        "drained": r.drained(),
        "key_refused": r.key_refused(),
        "in_flight": r.in_flight(),
        "models": r.models().map(|m| m.to_vec()),
        "pinned_bytes": r.pinned_bytes(),
        "engine": r.engine().map(|e| json!({
            "requests_unseen": e.unseen,
            "kv_used_permille": e.kv_used_permille,
        })),
    })
}

fn ok(body: Value) -> Response<Vec<u8>> {
    respond(StatusCode::OK, body)
}

fn not_allowed(allow: &'static str) -> Response<Vec<u8>> {
    let mut r = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        &format!("this path takes {allow}"),
    );
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

fn error(status: StatusCode, code: &str, message: &str) -> Response<Vec<u8>> {
    let kind = if status == StatusCode::UNAUTHORIZED {
        "authentication_error"
    } else {
        "invalid_request_error"
    };
    respond(
        status,
        json!({"error": {"message": message, "type": kind, "code": code}}),
    )
}

fn respond(status: StatusCode, body: Value) -> Response<Vec<u8>> {
    let mut bytes = body.to_string().into_bytes();
    bytes.push(b'\n');
    let len = bytes.len();
    let mut r = Response::new(bytes);
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "admin-secret";

    fn keys() -> ApiKeys {
        use sha2::{Digest, Sha256};
        let digest: String = Sha256::digest(KEY)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        ApiKeys::parse(&digest).unwrap()
    }

    fn call(set: &Replicas, method: Method, path: &str, key: Option<&str>) -> (u16, Value) {
        let bearer = key.map(|k| format!("Bearer {k}"));
        let keys = keys();
        let r = answer(
            set,
            &Metrics::standalone(),
            &keys,
            &method,
            path,
            bearer.as_deref().map(str::as_bytes),
        );
        (
            r.status().as_u16(),
            serde_json::from_slice(r.body()).unwrap(),
        )
    }

    fn one(name: &str) -> Replicas {
        let c = crate::config::Replica::at(name, "127.0.0.1:1");
        Replicas::new(&[c], Metrics::standalone())
    }

    #[test]
    fn drain_and_undrain_set_the_replica_and_answer_its_state() {
        let set = one("a");
        let (status, body) = call(&set, Method::POST, "/admin/replicas/a/drain", Some(KEY));
        assert_eq!((status, &body["drained"]), (200, &json!(true)));
        assert!(set.snapshot()[0].drained());
        let (status, body) = call(&set, Method::POST, "/admin/replicas/a/undrain", Some(KEY));
        assert_eq!((status, &body["drained"]), (200, &json!(false)));
        assert!(!set.snapshot()[0].drained());
    }

    #[test]
    fn every_path_needs_a_key_and_bad_requests_get_json_errors() {
        let set = one("a");
        for key in [None, Some("wrong")] {
            let (status, body) = call(&set, Method::POST, "/admin/replicas/a/drain", key);
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (401, Some("invalid_api_key"))
            );
        }
        assert!(!set.snapshot()[0].drained(), "drained without a key");
        let cases = [
            (Method::GET, "/admin/replicas", 200, None),
            (Method::GET, "/admin/replicas/", 200, None),
            (Method::GET, "/admin/replicas/a", 200, None),
            (
                Method::GET,
                "/admin/replicas/zz",
                404,
                Some("replica_not_found"),
            ),
            (
                Method::GET,
                "/admin/replicas/a/drain",
                405,
                Some("method_not_allowed"),
            ),
            (
                Method::POST,
                "/admin/replicas",
                405,
                Some("method_not_allowed"),
            ),
            (
                Method::POST,
                "/admin/replicas/a/reboot",
                404,
                Some("not_found"),
            ),
            (Method::GET, "/admin/other", 404, Some("not_found")),
            (Method::GET, "/admin/replicasx", 404, Some("not_found")),
        ];
        for (method, path, want, code) in cases {
            let (status, body) = call(&set, method, path, Some(KEY));
            assert_eq!(status, want, "{path}: {body}");
            assert_eq!(body["error"]["code"].as_str(), code, "{path}");
        }
        let (_, list) = call(&set, Method::GET, "/admin/replicas", Some(KEY));
        assert_eq!(list["replicas"][0]["name"], "a");
        assert_eq!(list["replicas"][0]["health"], "down");
    }
}
