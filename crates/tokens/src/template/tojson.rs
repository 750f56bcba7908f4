//! transformers' `tojson` filter for chat templates: Python's `json.dumps`
//! (its separators, `indent`, `sort_keys`, `ensure_ascii`), maps in the
//! client's order.

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};

/// transformers' `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`: `json.dumps` with those, by position
/// or by name.
pub fn tojson(
    value: Value,
    ensure_ascii: Option<bool>,
    indent: Option<usize>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let indent = kwargs.get::<Option<usize>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?.or(separators);
    let (item, key) = match separators.filter(|s| !s.is_none()) {
        Some(s) => {
            let part = |i: usize| -> Result<String, Error> {
                Ok(s.get_item(&Value::from(i))?
                    .as_str()
                    .unwrap_or_default()
                    .to_owned())
            };
            (part(0)?, part(1)?)
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let dumps = Dumps {
        indent,
        sort: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ascii: kwargs
            .get::<Option<bool>>("ensure_ascii")?
            .or(ensure_ascii)
            .unwrap_or(false),
        item,
        key,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dumps.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` options.
struct Dumps {
    indent: Option<usize>,
    sort: bool,
    ascii: bool,
    item: String,
    key: String,
}

impl Dumps {
    /// `v` into `out`, maps in their order (unless sorted).
    fn write(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        use minijinja::value::ValueKind as K;
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', n * depth));
            }
        };
        let (open, close, keys): (char, char, Option<Vec<Value>>) = match v.kind() {
            K::Seq | K::Iterable => ('[', ']', None),
            K::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort();
                }
                ('{', '}', Some(keys))
            }
            K::Undefined | K::None => {
                out.push_str("null");
                return Ok(());
            }
            _ => return self.scalar(v, out),
        };
        let items: Vec<(Option<Value>, Value)> = match keys {
            Some(keys) => (keys.into_iter())
                .map(|k| Ok((Some(k.clone()), v.get_item(&k)?)))
                .collect::<Result<_, Error>>()?,
            None => v.try_iter()?.map(|x| (None, x)).collect(),
        };
        out.push(open);
        for (i, (k, x)) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            if let Some(k) = k {
                self.scalar(&Value::from(k.to_string()), out)?;
                out.push_str(&self.key);
            }
            self.write(x, depth + 1, out)?;
        }
        if !items.is_empty() {
            newline(out, depth);
        }
        out.push(close);
        Ok(())
    }

    /// A string, number or bool as `json.dumps` writes it.
    fn scalar(&self, v: &Value, out: &mut String) -> Result<(), Error> {
        let json = serde_json::to_string(v)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        if !self.ascii {
            out.push_str(&json);
            return Ok(());
        }
        for c in json.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    #[test]
    fn tojson_writes_python_s_json_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, "é😀"], "a": {}, "c": null}"#).expect("json");
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        let out = env
            .render_str(
                "{{ v|tojson }}|{{ v|tojson(indent=2, sort_keys=true) }}|{{ v|tojson(separators=(',', ':')) }}|{{ v|tojson(true) }}|{{ [] |tojson(indent=2) }}",
                minijinja::context! { v => v },
            )
            .expect("renders");
        let parts: Vec<&str> = out.split('|').collect();
        // Python: json.dumps(v, ensure_ascii=False), in the client's order.
        assert_eq!(parts[0], r#"{"b": [1, 2.5, "é😀"], "a": {}, "c": null}"#);
        assert_eq!(
            parts[1],
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"é😀\"\n  ],\n  \"c\": null\n}"
        );
        assert_eq!(parts[2], r#"{"b":[1,2.5,"é😀"],"a":{},"c":null}"#);
        assert_eq!(
            parts[3],
            r#"{"b": [1, 2.5, "\u00e9\ud83d\ude00"], "a": {}, "c": null}"#
        );
        assert_eq!(parts[4], "[]");
    }
}
