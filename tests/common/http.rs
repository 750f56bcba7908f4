//! A blocking HTTP/1.1 client for tests: one request per connection
//! (`Connection: close`), Content-Length or chunked bodies, `Expect: 100-continue`,
//! and SSE read event by event. Every read has a 60 s timeout, so no test hangs.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A whole response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// A `100 Continue` arrived before the final response.
    pub continued: bool,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `x-prefix-router-replica`.
    pub fn replica(&self) -> &str {
        self.header("x-prefix-router-replica").unwrap_or("")
    }

    /// `x-prefix-router-decision`.
    pub fn decision(&self) -> &str {
        self.header("x-prefix-router-decision").unwrap_or("")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

/// How the request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    ContentLength,
    /// Chunked, in chunks of this many bytes.
    Chunked(usize),
}

fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn write_head(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    framing: Framing,
    len: usize,
) -> io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match framing {
        Framing::ContentLength => head.push_str(&format!("content-length: {len}\r\n")),
        Framing::Chunked(_) => head.push_str("transfer-encoding: chunked\r\n"),
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())
}

fn write_body(s: &mut TcpStream, body: &[u8], framing: Framing) -> io::Result<()> {
    match framing {
        Framing::ContentLength => s.write_all(body),
        Framing::Chunked(size) => {
            for chunk in body.chunks(size.max(1)) {
                s.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())?;
                s.write_all(chunk)?;
                s.write_all(b"\r\n")?;
            }
            s.write_all(b"0\r\n\r\n")
        }
    }
}

/// Sends one request; `Err` only for connection-level failures.
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    send(addr, method, path, headers, body, Framing::ContentLength)
}

/// Sends one request with the given framing.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    framing: Framing,
) -> io::Result<Response> {
    let mut s = connect(addr)?;
    write_head(&mut s, method, path, headers, framing, body.len())?;
    let expect = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("expect") && v.eq_ignore_ascii_case("100-continue"));
    let mut r = BufReader::new(s.try_clone()?);
    let mut continued = false;
    if expect {
        // Wait for the interim response before sending the body, as curl does.
        let (status, _) = read_head(&mut r)?;
        let headers = read_rest_of_head(&mut r)?;
        if status != 100 {
            return finish(&mut r, status, headers, false);
        }
        continued = true;
    }
    // A server may answer (413) before the whole body is written.
    let _ = write_body(&mut s, body, framing);
    let mut resp = read_response(&mut r)?;
    resp.continued |= continued;
    Ok(resp)
}

/// Declares a `declared`-byte body, sends only `partial`, and waits for the answer.
pub fn send_stalled(addr: SocketAddr, path: &str, declared: usize, partial: &[u8]) -> Response {
    let s = stall_upload(addr, path, &[], declared, partial);
    read_response(&mut BufReader::new(s)).expect("response")
}

/// Declares a `declared`-byte body, sends only `partial`, and returns the
/// open connection.
pub fn stall_upload(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    declared: usize,
    partial: &[u8],
) -> TcpStream {
    let mut s = connect(addr).expect("connect");
    write_head(
        &mut s,
        "POST",
        path,
        headers,
        Framing::ContentLength,
        declared,
    )
    .expect("head");
    s.write_all(partial).expect("partial body");
    s
}

/// Sends one request; panics on connection failure.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_request(addr, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path} to {addr}: {e}"))
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"")
}

pub fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Response {
    let bytes = serde_json::to_vec(body).expect("json");
    request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        &bytes,
    )
}

/// Server side, for hand-made replicas: reads one whole request (head and a
/// Content-Length body); its request line, `None` once the client closed.
pub fn read_request(r: &mut impl BufRead) -> Option<String> {
    let head = read_request_head(r)?;
    Some(head.lines().next().unwrap_or_default().to_owned() + "\r\n")
}

/// Reads one request (its body read and dropped); returns its head.
pub fn read_request_head(r: &mut impl BufRead) -> Option<String> {
    let mut head = String::new();
    if r.read_line(&mut head).ok()? == 0 {
        return None;
    }
    let mut length = 0;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        head.push_str(&line);
    }
    r.read_exact(&mut vec![0; length]).ok()?;
    Some(head)
}

fn read_head(r: &mut impl BufRead) -> io::Result<(u16, String)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed before a response",
        ));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })?;
    Ok((status, line))
}

fn read_rest_of_head(r: &mut impl BufRead) -> io::Result<Vec<(String, String)>> {
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            return Ok(headers);
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"))
}

fn read_body(r: &mut impl BufRead, headers: &[(String, String)]) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if is_chunked(headers) {
        while let Some(chunk) = read_chunk(r)? {
            body.extend_from_slice(&chunk);
        }
    } else if let Some(len) = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok())
    {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// One chunk of a chunked body; `None` at the terminating chunk.
fn read_chunk(r: &mut impl BufRead) -> io::Result<Option<Vec<u8>>> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let size =
        usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad chunk size {line:?}"),
            )
        })?;
    let mut chunk = vec![0; size];
    r.read_exact(&mut chunk)?;
    let mut crlf = [0; 2];
    r.read_exact(&mut crlf)?;
    if size == 0 {
        return Ok(None);
    }
    Ok(Some(chunk))
}

/// A streaming (SSE) response read event by event.
pub struct EventStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    buf: Vec<u8>,
    chunked: bool,
    done: bool,
}

impl EventStream {
    /// `POST path` with a JSON body; returns once the response head arrived.
    pub fn open(addr: SocketAddr, path: &str, body: &serde_json::Value) -> EventStream {
        Self::open_with(addr, path, &[], body)
    }

    /// As [`EventStream::open`], with more request headers.
    pub fn open_with(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> EventStream {
        let bytes = serde_json::to_vec(body).expect("json");
        let mut s = connect(addr).expect("connect");
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        write_head(
            &mut s,
            "POST",
            path,
            &all,
            Framing::ContentLength,
            bytes.len(),
        )
        .expect("write head");
        s.write_all(&bytes).expect("write body");
        let mut reader = BufReader::new(s);
        let (status, _) = read_head(&mut reader).expect("status");
        let headers = read_rest_of_head(&mut reader).expect("headers");
        let chunked = is_chunked(&headers);
        EventStream {
            status,
            headers,
            reader,
            buf: Vec::new(),
            chunked,
            done: false,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The next SSE event (without its blank line), `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..pos + 2).collect();
                return Some(String::from_utf8_lossy(&event[..pos]).into_owned());
            }
            if self.done {
                return None;
            }
            let more = if self.chunked {
                read_chunk(&mut self.reader).expect("chunk")
            } else {
                let mut b = vec![0; 4096];
                let n = self.reader.read(&mut b).expect("read");
                b.truncate(n);
                Some(b).filter(|b| !b.is_empty())
            };
            match more {
                Some(b) => self.buf.extend_from_slice(&b),
                None => self.done = true,
            }
        }
    }
}

/// Sends a body-less keep-alive `POST` on an open connection and reads the
/// whole (Content-Length) response; panics unless it is a 200.
pub fn keepalive_post(s: &mut TcpStream, path: &str) {
    let head = format!("POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n");
    s.write_all(head.as_bytes()).expect("write");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let (status, line) = read_head(&mut r).expect("status");
    let headers = read_rest_of_head(&mut r).expect("headers");
    read_body(&mut r, &headers).expect("body");
    assert_eq!(status, 200, "{line}");
}

/// Writes raw bytes, half-closes, and returns everything the server sent
/// until it closed (or 10 s passed).
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Writes a request in pieces, each on its own after a pause (a slow
/// client: the server most likely reads each alone), then reads the answer.
pub fn in_pieces(addr: SocketAddr, pieces: &[&[u8]]) -> io::Result<Response> {
    let mut s = connect(addr)?;
    s.set_nodelay(true)?;
    for piece in pieces {
        s.write_all(piece)?;
        std::thread::sleep(Duration::from_millis(5));
    }
    read_response(&mut BufReader::new(s))
}

/// Writes whole requests back to back in one write on one connection
/// (pipelined), then reads one response for each, in order.
pub fn pipelined(addr: SocketAddr, requests: &[Vec<u8>]) -> Vec<io::Result<Response>> {
    let mut s = connect(addr).expect("connect");
    s.write_all(&requests.concat()).expect("write");
    let mut r = BufReader::new(s);
    requests.iter().map(|_| read_response(&mut r)).collect()
}

/// Writes a request head and the *whole* body before reading anything, as
/// Python's `http.client` and many SDKs do; the response, or the error that
/// writing or reading met.
pub fn send_then_read(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    framing: Framing,
) -> io::Result<Response> {
    let mut s = connect(addr)?;
    write_head(&mut s, "POST", path, headers, framing, body.len())?;
    write_body(&mut s, body, framing)?;
    read_response(&mut BufReader::new(s))
}

/// A whole final response (status, headers, body), past any `100 Continue`.
fn read_response(r: &mut impl BufRead) -> io::Result<Response> {
    let mut continued = false;
    loop {
        let (status, _) = read_head(r)?;
        let headers = read_rest_of_head(r)?;
        if status != 100 {
            return finish(r, status, headers, continued);
        }
        continued = true;
    }
}

/// Reads the body that follows a final response head.
fn finish(
    r: &mut impl BufRead,
    status: u16,
    headers: Vec<(String, String)>,
    continued: bool,
) -> io::Result<Response> {
    let body = read_body(r, &headers)?;
    Ok(Response {
        status,
        headers,
        body,
        continued,
    })
}

/// Sends `bodies` as `POST path` one after another over keep-alive
/// connections, as a well-behaved client does: a connection is reused unless
/// the server said `connection: close`. A transport error on a reused
/// connection (the server closed one it had offered for reuse) is an `Err`.
pub fn keepalive_posts(
    addr: SocketAddr,
    path: &str,
    bodies: &[Vec<u8>],
) -> Vec<io::Result<Response>> {
    let mut conn: Option<(TcpStream, BufReader<TcpStream>)> = None;
    bodies
        .iter()
        .map(|body| {
            let (s, r) = match conn.as_mut() {
                Some(c) => c,
                None => {
                    let s = connect(addr)?;
                    let r = BufReader::new(s.try_clone()?);
                    conn.insert((s, r))
                }
            };
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            let result = (|| {
                s.write_all(head.as_bytes())?;
                s.write_all(body)?;
                read_response(r)
            })();
            let keep = matches!(&result, Ok(resp) if resp.header("connection") != Some("close"));
            if !keep {
                conn = None;
            }
            result
        })
        .collect()
}
