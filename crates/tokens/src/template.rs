//! A model's chat template (`chat_template` in its `tokenizer_config.json`:
//! one Jinja source, or named ones, `tool_use` taken when tools are given,
//! else `default`), rendered as transformers renders it: blocks trimmed and
//! left-stripped, loop controls, Python's string and dict methods
//! (`minijinja-contrib`'s pycompat), `raise_exception`, `strftime_now`, and
//! `tojson` writing Python's `json.dumps` (`", "` and `": "` separators,
//! non-ASCII kept, `indent` and `sort_keys` honoured). The special tokens the
//! config names (`bos_token`, `eos_token`, ...) are in the context.
//! Rendering is metered (minijinja's fuel), so no template runs unbounded.

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

use crate::TokensError;

mod tojson;
use tojson::tojson;

/// Template instructions one rendering may run.
const FUEL: u64 = 50_000_000;
/// ... and one rendering of a probe conversation at load (a few messages:
/// a template that needs more is taken as not windowed, at a fiftieth of
/// a full rendering's cost).
const PROBE_FUEL: u64 = 1_000_000;

/// What a conversation's next messages add to its render
/// ([`ChatTemplate::render_after`]): `text`, the generation prompt last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub text: String,
    /// Bytes of `text` before the generation prompt.
    pub head: usize,
}

impl Window {
    /// The text without the generation prompt.
    pub fn head(&self) -> &str {
        &self.text[..self.head]
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Named templates besides `default` (`tool_use`).
    tool_use: bool,
    tokens: Vec<(&'static str, String)>,
    /// See [`ChatTemplate::windowed`].
    windowed: bool,
}

impl ChatTemplate {
    /// From a parsed `tokenizer_config.json`.
    pub fn from_config(config: &serde_json::Value) -> Result<Self, TokensError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let bad = |why: String| TokensError::Template(why);
        let mut tool_use = false;
        match &config["chat_template"] {
            serde_json::Value::String(source) => {
                env.add_template_owned("default", source.clone())
                    .map_err(|e| bad(e.to_string()))?;
            }
            serde_json::Value::Array(named) => {
                for t in named {
                    let (Some(name), Some(source)) = (t["name"].as_str(), t["template"].as_str())
                    else {
                        return Err(bad("a named template needs `name` and `template`".into()));
                    };
                    tool_use |= name == "tool_use";
                    env.add_template_owned(name.to_owned(), source.to_owned())
                        .map_err(|e| bad(format!("{name}: {e}")))?;
                }
            }
            _ => return Err(bad("tokenizer_config.json has no chat_template".into())),
        }
        env.get_template("default")
            .map_err(|_| bad("no template named `default`".into()))?;
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(s) => Some(s.clone()),
            v => v["content"].as_str().map(str::to_owned),
        };
        let tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .filter_map(|k| token(k).map(|v| (k, v)))
            .collect();
        let mut template = Self {
            env,
            tool_use,
            tokens,
            windowed: false,
        };
        // A template that writes the date renders an earlier turn otherwise
        // the next day: never windowed.
        let dated = (template.env.templates()).any(|(_, t)| t.source().contains("strftime_now"));
        template.env.set_fuel(Some(PROBE_FUEL));
        template.windowed = !dated && template.renders_windows();
        template.env.set_fuel(Some(FUEL));
        Ok(template)
    }

    /// Whether a conversation's next turn can be rendered from its new
    /// messages alone ([`ChatTemplate::render_after`]) and come out as the
    /// whole render would: found at load by rendering probe conversations
    /// (with and without a system prompt, tools, tool calls and their
    /// results, an assistant's reasoning) whole and split at every message.
    /// A template that renders earlier messages otherwise as the
    /// conversation grows (one that drops earlier reasoning, one that
    /// checks roles alternate from the first) is not, nor one that writes
    /// the date (`strftime_now`).
    pub fn windowed(&self) -> bool {
        self.windowed
    }

    /// What the messages `new` add to the render of a conversation whose
    /// last message is `last` (rendered without the generation prompt),
    /// the generation prompt `generation` last (see
    /// [`ChatTemplate::generation_prompt`]): the render of `[last, new..]`
    /// past that of `[last]` alone. The whole conversation's render is the
    /// earlier messages' (without the generation prompt) and this, for a
    /// template found [`windowed`](ChatTemplate::windowed); without its
    /// generation prompt (its first [`Window::head`] bytes), it is what the
    /// conversation's render without one adds.
    pub fn render_after(
        &self,
        last: &Value,
        new: &[Value],
        tools: Option<Value>,
        kwargs: Option<Value>,
        generation: &str,
    ) -> Result<Window, TokensError> {
        let alone = self.render_with(
            Value::from(vec![last.clone()]),
            tools.clone(),
            kwargs.clone(),
            false,
        )?;
        let window: Vec<Value> = std::iter::once(last.clone())
            .chain(new.iter().cloned())
            .collect();
        let with = self.render_with(Value::from(window), tools, kwargs, true)?;
        let text = with
            .strip_prefix(alone.as_str())
            .ok_or(TokensError::Unsupported(
                "a template that renders earlier messages again",
            ))?;
        let head = text
            .strip_suffix(generation)
            .ok_or(TokensError::Unsupported(
                "a generation prompt that changes with the messages",
            ))?;
        Ok(Window {
            head: head.len(),
            text: text.to_owned(),
        })
    }

    /// What the generation prompt adds after a conversation whose last
    /// message is `last` (the same after any, for a template found
    /// [`windowed`](ChatTemplate::windowed), given the tools and arguments).
    pub fn generation_prompt(
        &self,
        last: &Value,
        tools: Option<Value>,
        kwargs: Option<Value>,
    ) -> Result<String, TokensError> {
        let alone = |generation| {
            let messages = Value::from(vec![last.clone()]);
            self.render_with(messages, tools.clone(), kwargs.clone(), generation)
        };
        let (with, without) = (alone(true)?, alone(false)?);
        (with.strip_prefix(without.as_str()))
            .map(str::to_owned)
            .ok_or(TokensError::Unsupported(
                "a generation prompt that changes the messages",
            ))
    }

    /// Every probe conversation renders the same whole (with and without
    /// the generation prompt) and as its first messages (no generation
    /// prompt) followed by the rest rendered after them, down to none, with
    /// the same generation prompt after every message; at least one
    /// renders.
    fn renders_windows(&self) -> bool {
        let mut rendered = 0;
        for conversation in probe_conversations() {
            for tools in [None, Some(probe_tools())] {
                let messages: Vec<Value> = conversation.iter().map(Value::from_serialize).collect();
                let whole = |generation: bool| {
                    self.render_with(
                        Value::from(messages.clone()),
                        tools.clone(),
                        None,
                        generation,
                    )
                };
                let Ok(with) = whole(true) else {
                    continue;
                };
                let Ok(without) = whole(false) else {
                    return false;
                };
                let Ok(generation) = self.generation_prompt(&messages[0], tools.clone(), None)
                else {
                    return false;
                };
                for k in 1..=messages.len() {
                    let last = &messages[k - 1];
                    let head = self.render_with(
                        Value::from(messages[..k].to_vec()),
                        tools.clone(),
                        None,
                        false,
                    );
                    let same = self.generation_prompt(last, tools.clone(), None);
                    let after =
                        self.render_after(last, &messages[k..], tools.clone(), None, &generation);
                    let (Ok(head), Ok(same), Ok(after)) = (head, same, after) else {
                        return false;
                    };
                    let rest = with.strip_prefix(head.as_str());
                    let rest_without = without.strip_prefix(head.as_str());
                    if same != generation
                        || rest != Some(after.text.as_str())
                        || rest_without != Some(after.head())
                    {
                        return false;
                    }
                }
                rendered += 1;
            }
        }
        rendered > 0
    }

    /// The prompt text of a chat request `body` (its JSON: `messages`,
    /// `tools`, `chat_template_kwargs`), with the generation prompt. Maps
    /// keep the order the client wrote them in; a content given as text
    /// parts is joined by newlines, as vLLM does for templates that expect
    /// a string.
    pub fn render_body(&self, body: &[u8]) -> Result<String, TokensError> {
        self.render_value(&parse_body(body)?)
    }

    /// As [`ChatTemplate::render_body`], the body parsed.
    pub fn render_value(&self, body: &Value) -> Result<String, TokensError> {
        let (messages, tools, kwargs) = fields(body)?;
        self.render(messages, tools, kwargs)
    }

    /// The prompt text of `messages` (see [`ChatTemplate::render_body`]).
    pub fn render(
        &self,
        messages: Value,
        tools: Option<Value>,
        kwargs: Option<Value>,
    ) -> Result<String, TokensError> {
        self.render_with(messages, tools, kwargs, true)
    }

    /// As [`ChatTemplate::render`]; `generation`: the generation prompt added.
    pub fn render_with(
        &self,
        messages: Value,
        tools: Option<Value>,
        kwargs: Option<Value>,
        generation: bool,
    ) -> Result<String, TokensError> {
        let name = if tools.is_some() && self.tool_use {
            "tool_use"
        } else {
            "default"
        };
        let template =
            (self.env.get_template(name)).map_err(|e| TokensError::Template(e.to_string()))?;
        let mut ctx: Vec<(String, Value)> = (self.tokens.iter())
            .map(|(k, v)| ((*k).to_owned(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages".into(), flatten(&messages)?));
        if let Some(tools) = tools {
            ctx.push(("tools".into(), tools));
        }
        ctx.push(("add_generation_prompt".into(), Value::from(generation)));
        if let Some(kwargs) = kwargs {
            for k in kwargs
                .try_iter()
                .map_err(|e| TokensError::Template(e.to_string()))?
            {
                let v = kwargs.get_item(&k).unwrap_or_default();
                ctx.push((k.to_string(), v));
            }
        }
        template
            .render(Value::from_iter(ctx))
            .map_err(|e| TokensError::Template(e.to_string()))
    }
}

/// A parsed body's messages, tools and template arguments.
pub(crate) fn fields(body: &Value) -> Result<(Value, Option<Value>, Option<Value>), TokensError> {
    let get = |key: &str| {
        body.get_attr(key)
            .ok()
            .filter(|v| !v.is_undefined() && !v.is_none())
    };
    let messages = get("messages").ok_or_else(|| TokensError::Template("no messages".into()))?;
    Ok((messages, get("tools"), get("chat_template_kwargs")))
}

/// Conversations a template's windows are checked on: with and without a
/// system prompt, a tool call and its result, an assistant's reasoning
/// before a later user turn, text parts.
fn probe_conversations() -> Vec<Vec<serde_json::Value>> {
    use serde_json::json;
    let user = |n: u32| json!({"role": "user", "content": format!("question {n}")});
    let assistant = |n: u32| json!({"role": "assistant", "content": format!("answer {n}")});
    let system = json!({"role": "system", "content": "Be terse."});
    let call = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]});
    let result = json!({"role": "tool", "tool_call_id": "call_1", "content": "found x"});
    let reasoning = json!({"role": "assistant", "content": "<think>\nweigh it\n</think>\n\nanswer",
        "reasoning_content": "weigh it"});
    let parts = json!({"role": "user", "content": [{"type": "text", "text": "part a"},
        {"type": "text", "text": "part b"}]});
    vec![
        vec![system.clone(), user(1), assistant(1), user(2)],
        vec![user(1), assistant(1), user(2), assistant(2), user(3)],
        vec![system, user(1), call, result, assistant(1), user(2)],
        vec![user(1), reasoning, user(2), assistant(2), parts],
    ]
}

fn probe_tools() -> Value {
    Value::from_serialize(
        serde_json::json!([{"type": "function", "function": {"name": "lookup",
        "description": "Looks a word up.", "parameters": {"type": "object",
        "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]),
    )
}

/// Messages with text-part contents joined into one string.
fn flatten(messages: &Value) -> Result<Value, TokensError> {
    let bad = |e: Error| TokensError::Template(e.to_string());
    let mut out = Vec::new();
    for m in messages.try_iter().map_err(bad)? {
        let content = m.get_attr("content").unwrap_or_default();
        let texts: Option<Vec<String>> = match content.kind() {
            minijinja::value::ValueKind::Seq => content
                .try_iter()
                .map_err(bad)?
                .map(|p| {
                    let text = p.get_attr("text").ok()?;
                    (p.get_attr("type").ok()?.as_str() == Some("text"))
                        .then(|| text.as_str().map(str::to_owned))
                        .flatten()
                })
                .collect::<Option<Vec<String>>>()
                .map(Some)
                .ok_or(TokensError::Unsupported("a content part other than text"))?,
            _ => None,
        };
        let Some(texts) = texts else {
            out.push(m);
            continue;
        };
        let mut fields: Vec<(Value, Value)> = Vec::new();
        for k in m.try_iter().map_err(bad)? {
            let v = if k.as_str() == Some("content") {
                Value::from(texts.join("\n"))
            } else {
                m.get_item(&k).unwrap_or_default()
            };
            fields.push((k, v));
        }
        out.push(Value::from_iter(fields));
    }
    Ok(Value::from(out))
}

/// transformers' `strftime_now(format)`: the time now, formatted.
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = jiff::Zoned::now();
    Ok(Value::from(now.strftime(&format).to_string()))
}

/// A request body as the template reads it (its keys in their order).
pub fn parse_body(body: &[u8]) -> Result<Value, TokensError> {
    serde_json::from_slice(body).map_err(|e| TokensError::Template(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn templates_render_as_transformers_does() {
        let config = json!({"bos_token": "<s>", "chat_template":
            "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content.strip() }}\n{% else %}[{{ m.role|upper }}] {{ m.content }}\n{% endif %}{% endfor %}{% if tools %}{{ tools|tojson }}{% endif %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"});
        let t = ChatTemplate::from_config(&config).expect("loads");
        let body = r#"{"messages": [{"role": "system", "content": "  Be terse.  "},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "tools": [{"name": "f", "a": 1}]}"#;
        let text = t.render_body(body.as_bytes()).expect("renders");
        assert_eq!(
            text,
            "<s>Be terse.\n[USER] a\nb\n[{\"name\": \"f\", \"a\": 1}][ASSISTANT]"
        );
        let body: Value = serde_json::from_str(body).expect("json");
        let messages = body.get_attr("messages").expect("messages");
        let raising = json!({"chat_template": "{{ raise_exception('no system role') }}"});
        let t = ChatTemplate::from_config(&raising).expect("loads");
        let err = t.render(messages.clone(), None, None).expect_err("raises");
        assert!(err.to_string().contains("no system role"), "{err}");
        let runaway = json!({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"});
        let t = ChatTemplate::from_config(&runaway).expect("loads");
        assert!(t.render(messages, None, None).is_err(), "fuel ran out");
    }

    #[test]
    fn templates_that_render_a_turn_from_its_new_messages_alone_are_found() {
        let chatml = "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::from_config(&json!({"chat_template": chatml})).expect("loads");
        assert!(t.windowed());
        let m = |role: &str, content: &str| {
            Value::from_serialize(json!({"role": role, "content": content}))
        };
        let conversation = [m("user", "a"), m("assistant", "b"), m("user", "c")];
        let whole = t
            .render(Value::from(conversation.to_vec()), None, None)
            .expect("renders");
        let head = (t.render_with(Value::from(conversation[..2].to_vec()), None, None, false))
            .expect("renders");
        let generation = (t.generation_prompt(&conversation[1], None, None)).expect("renders");
        assert_eq!(generation, "<|im_start|>assistant\n");
        let after = (t.render_after(
            &conversation[1],
            &conversation[2..],
            None,
            None,
            &generation,
        ))
        .expect("renders");
        assert_eq!(
            after.text,
            "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(after.head(), "<|im_start|>user\nc<|im_end|>\n");
        assert_eq!(head + &after.text, whole);

        // Earlier reasoning dropped once a later turn comes: not windowed.
        let drops = "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
        let t = ChatTemplate::from_config(&json!({"chat_template": drops})).expect("loads");
        assert!(!t.windowed());
        // Roles checked from the first message: a window starting at an
        // answer raises, so not windowed.
        let alternates = "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::from_config(&json!({"chat_template": alternates})).expect("loads");
        assert!(!t.windowed());
        // The date written: an earlier turn renders otherwise the next day.
        let dated = format!("{{{{ strftime_now('%d %B %Y') }}}}\n{chatml}");
        let t = ChatTemplate::from_config(&json!({"chat_template": dated})).expect("loads");
        assert!(!t.windowed());
        // Tools written after the messages: an earlier render is no prefix.
        let tools_last = "{% for m in messages %}{{ m.content }}\n{% endfor %}{% if tools %}{{ tools|tojson }}{% endif %}";
        let t = ChatTemplate::from_config(&json!({"chat_template": tools_last})).expect("loads");
        assert!(!t.windowed());
    }
}
