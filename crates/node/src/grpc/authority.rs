//! Rewrites the HTTP/2 `:authority` of every request on a connection, before h2 parses it.
//!
//! Kubelet clients do not agree on what a unix socket's authority is: the plugin watcher
//! (grpc-go, bare path target) sends the percent-encoded socket path, the device manager and the
//! DRA client send `localhost`, grpc-java and older grpc-go send the raw path or nothing. h2
//! accepts only a valid URI authority and resets any other request with PROTOCOL_ERROR, so a
//! tonic server must never see the others. [`Rewriter`] is sans-IO: it consumes the bytes a
//! client sends (preface, then frames), passes every frame through unchanged except header
//! blocks (HEADERS + CONTINUATION), which it decodes with HPACK and rewrites per [`Policy`].
//! Decoding every block keeps our decoder's dynamic table in step with the client's encoder.
//! From the first block that is changed on, every block is re-encoded as literals without
//! indexing, which leaves the server's table untouched (it then lacks what the client indexed,
//! and nothing we send refers to it).
//!
//! The fast path: a client sends one authority for all of a connection's requests (grpc-go and
//! grpc-java derive it from the channel's target; the kubelet sets no per-call authority), so
//! when the first request's authority is one h2 accepts (the device manager's and the DRA
//! client's `localhost`), the connection passes through untouched from then on and costs
//! nothing ([`Rewriter::passes_through`]). Only connections whose first request needed a
//! rewrite (the plugin watcher's) keep paying for HPACK.

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may announce: frames we write never exceed it.
const MIN_MAX_FRAME_SIZE: usize = 16_384;
/// The HPACK table size a server decoder has unless it announces another; h2 (under tonic)
/// announces none, so no client may grow its table beyond this.
const DEFAULT_TABLE_SIZE: usize = 4_096;
/// A compressed header block larger than this is refused: gRPC metadata is a few hundred
/// bytes, and a block is buffered whole before it is decoded.
pub const MAX_HEADER_BLOCK: usize = 256 * 1024;

/// What happens to `:authority`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// Server side: a value that is not a valid URI authority (a socket path, encoded or raw,
    /// or an empty one) becomes [`Policy::LOCALHOST`]; a valid one and an absent one stay.
    Normalize,
    /// Client side (test doubles that speak as a given real client does): every request carries
    /// exactly this value, or no `:authority` at all for `None`.
    Send(Option<Vec<u8>>),
}

impl Policy {
    pub const LOCALHOST: &'static [u8] = b"localhost";
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RewriteError {
    #[error("HTTP/2 header block of stream {stream} is over {MAX_HEADER_BLOCK} bytes")]
    BlockTooLarge { stream: u32 },
    #[error(
        "HTTP/2 frame of type {frame_type:#x} where a CONTINUATION of stream {stream} was due"
    )]
    ContinuationExpected { stream: u32, frame_type: u8 },
    #[error(
        "HTTP/2 HEADERS frame of stream {stream} is shorter than its padding or priority fields"
    )]
    BadHeadersFrame { stream: u32 },
    #[error("HPACK header block of stream {stream} does not decode: {reason}")]
    Hpack { stream: u32, reason: String },
}

enum State {
    /// Bytes of the client preface still to pass.
    Preface(usize),
    /// Waiting for a complete frame header (and, for header frames, the whole payload).
    Frame,
    /// Passing this many more payload bytes of a frame that is not rewritten.
    Passing(usize),
    /// Not HTTP/2 with prior knowledge (the preface did not match): pass everything so the
    /// server answers the client itself.
    Opaque,
    /// The first request's authority needed no change: pass everything (the fast path).
    Through,
}

/// A header block being collected: HEADERS and any CONTINUATION frames up to END_HEADERS.
struct Block {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client-to-server byte stream rewriter of one connection.
pub struct Rewriter {
    policy: Policy,
    state: State,
    pending: Vec<u8>,
    block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    /// Set once a block was re-encoded: the server's dynamic table then lacks what the client
    /// indexed in it, so every later block must be re-encoded too. Until then blocks pass with
    /// their HPACK bytes as they were (the kubelet's `localhost` clients never pay for more).
    reencoding: bool,
    /// A complete header block was seen: the fast path is decided on the first one only.
    seen_request: bool,
}

impl Rewriter {
    pub fn new(policy: Policy) -> Rewriter {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(DEFAULT_TABLE_SIZE);
        Rewriter {
            policy,
            state: State::Preface(0),
            pending: Vec::new(),
            block: None,
            decoder,
            reencoding: false,
            seen_request: false,
        }
    }

    /// True once everything from here on passes unchanged: the caller may then hand the
    /// connection's bytes to the server without calling [`Rewriter::push`].
    pub fn passes_through(&self) -> bool {
        matches!(self.state, State::Through | State::Opaque) && self.pending.is_empty()
    }

    /// Consumes `input` (any split of the stream) and appends what the server should read
    /// instead to `out`. Incomplete frames are kept for the next call.
    pub fn push(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), RewriteError> {
        loop {
            match self.state {
                State::Opaque | State::Through => {
                    out.extend_from_slice(input);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let want = &PREFACE[seen..];
                    let n = want.len().min(input.len());
                    if input[..n] != want[..n] {
                        self.state = State::Opaque;
                        out.extend_from_slice(&PREFACE[..seen]);
                        continue;
                    }
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if seen + n == PREFACE.len() {
                        State::Frame
                    } else {
                        State::Preface(seen + n)
                    };
                    if input.is_empty() {
                        return Ok(());
                    }
                }
                State::Passing(left) => {
                    let n = left.min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if n == left {
                        State::Frame
                    } else {
                        State::Passing(left - n)
                    };
                    if input.is_empty() {
                        return Ok(());
                    }
                }
                State::Frame => {
                    self.pending.extend_from_slice(input);
                    input = &[];
                    if !self.frame(out)? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Handles the frame at the head of `pending`; false when more bytes are needed.
    fn frame(&mut self, out: &mut Vec<u8>) -> Result<bool, RewriteError> {
        let Some(head) = self.pending.get(..FRAME_HEADER_LEN) else {
            return Ok(false);
        };
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let is_header = kind == HEADERS || kind == CONTINUATION;
        if let Some(b) = &self.block {
            if kind != CONTINUATION || stream != b.stream {
                return Err(RewriteError::ContinuationExpected {
                    stream: b.stream,
                    frame_type: kind,
                });
            }
        }
        if !is_header || (kind == CONTINUATION && self.block.is_none()) {
            // Not ours to touch (a stray CONTINUATION is h2's to refuse): stream it through.
            out.extend_from_slice(&self.pending[..FRAME_HEADER_LEN]);
            let body = len.min(self.pending.len() - FRAME_HEADER_LEN);
            out.extend_from_slice(&self.pending[FRAME_HEADER_LEN..FRAME_HEADER_LEN + body]);
            let rest = self.pending.split_off(FRAME_HEADER_LEN + body);
            self.pending = rest;
            self.state = if body == len {
                State::Frame
            } else {
                State::Passing(len - body)
            };
            return Ok(true);
        }
        let collected = self.block.as_ref().map_or(0, |b| b.fragment.len());
        if collected + len > MAX_HEADER_BLOCK {
            return Err(RewriteError::BlockTooLarge { stream });
        }
        if self.pending.len() < FRAME_HEADER_LEN + len {
            return Ok(false);
        }
        let payload: Vec<u8> = self
            .pending
            .drain(..FRAME_HEADER_LEN + len)
            .skip(FRAME_HEADER_LEN)
            .collect();
        if kind == HEADERS {
            self.block = Some(headers_frame(stream, flags, &payload)?);
        } else if let Some(b) = self.block.as_mut() {
            b.fragment.extend_from_slice(&payload);
        }
        if flags & END_HEADERS != 0 {
            if let Some(b) = self.block.take() {
                let first = !self.seen_request;
                self.seen_request = true;
                let changed = self.emit(b, out)?;
                if first && !changed && self.policy == Policy::Normalize {
                    out.append(&mut self.pending);
                    self.state = State::Through;
                }
            }
        }
        Ok(true)
    }

    /// Writes the block as the server should read it; whether it was changed.
    fn emit(&mut self, b: Block, out: &mut Vec<u8>) -> Result<bool, RewriteError> {
        let mut fields: HeaderList = Vec::new();
        self.decoder
            .decode_with_cb(&b.fragment, |n, v| {
                fields.push((n.into_owned(), v.into_owned()))
            })
            .map_err(|e| RewriteError::Hpack {
                stream: b.stream,
                reason: e.to_string(),
            })?;
        let (fields, changed) = rewrite(fields, &self.policy);
        self.reencoding |= changed;
        let mut encoded = Vec::with_capacity(b.fragment.len() + 32);
        if let Some(p) = &b.priority {
            encoded.extend_from_slice(p);
        }
        if self.reencoding {
            for (name, value) in &fields {
                encode_literal(name, value, &mut encoded);
            }
        } else {
            encoded.extend_from_slice(&b.fragment);
        }
        write_header_frames(b.stream, b.flags, b.priority.is_some(), &encoded, out);
        Ok(changed)
    }
}

/// Parses a HEADERS payload into the start of a block: padding dropped, priority kept.
fn headers_frame(stream: u32, flags: u8, payload: &[u8]) -> Result<Block, RewriteError> {
    let bad = || RewriteError::BadHeadersFrame { stream };
    let mut body = payload;
    if flags & PADDED != 0 {
        let (&pad, rest) = body.split_first().ok_or_else(bad)?;
        let keep = rest.len().checked_sub(usize::from(pad)).ok_or_else(bad)?;
        body = &rest[..keep];
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let p: [u8; 5] = body
            .get(..5)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(bad)?;
        priority = Some(p);
        body = &body[5..];
    }
    Ok(Block {
        stream,
        flags,
        priority,
        fragment: body.to_vec(),
    })
}

/// A decoded header block: (name, value) in order.
type HeaderList = Vec<(Vec<u8>, Vec<u8>)>;

/// Applies `policy` to a decoded header list; whether anything changed.
fn rewrite(mut fields: HeaderList, policy: &Policy) -> (HeaderList, bool) {
    const AUTHORITY: &[u8] = b":authority";
    let mut changed = false;
    match policy {
        Policy::Normalize => {
            for (name, value) in fields.iter_mut() {
                if name == AUTHORITY && !valid_authority(value) {
                    *value = Policy::LOCALHOST.to_vec();
                    changed = true;
                }
            }
        }
        Policy::Send(wanted) => {
            changed = true;
            let at = fields.iter().position(|(n, _)| n == AUTHORITY);
            fields.retain(|(n, _)| n != AUTHORITY);
            if let Some(v) = wanted {
                // Pseudo-headers come first; keep :authority where it was, or after them.
                let at = at.unwrap_or_else(|| {
                    fields
                        .iter()
                        .take_while(|(n, _)| n.starts_with(b":"))
                        .count()
                });
                fields.insert(at.min(fields.len()), (AUTHORITY.to_vec(), v.clone()));
            }
        }
    }
    (fields, changed)
}

/// True when h2 accepts `value` as the authority of a request.
pub fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// HPACK literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2).
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    encode_string(name, out);
    encode_string(value, out);
}

/// A string literal: length as a 7-bit-prefix integer (H bit clear), then the octets.
fn encode_string(s: &[u8], out: &mut Vec<u8>) {
    encode_integer(s.len(), 7, 0x00, out);
    out.extend_from_slice(s);
}

/// RFC 7541 §5.1 integer with an `n`-bit prefix; `first` carries the bits above the prefix.
fn encode_integer(mut value: usize, n: u32, first: u8, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if value < max {
        // value < 2^n <= 128, so it fits the prefix of one octet.
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Writes `block` (priority fields first when `has_priority`) as HEADERS plus CONTINUATION
/// frames no larger than the minimum frame size every peer accepts.
fn write_header_frames(
    stream: u32,
    flags: u8,
    has_priority: bool,
    block: &[u8],
    out: &mut Vec<u8>,
) {
    let keep = (flags & END_STREAM) | if has_priority { PRIORITY } else { 0 };
    let mut chunks: Vec<&[u8]> = block.chunks(MIN_MAX_FRAME_SIZE).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    for (i, chunk) in chunks.into_iter().enumerate() {
        let (kind, mut f) = if i == 0 {
            (HEADERS, keep)
        } else {
            (CONTINUATION, 0)
        };
        if i == last {
            f |= END_HEADERS;
        }
        let len = chunk.len().to_be_bytes();
        // A chunk is at most 16 KiB: its length fits the frame's 24 bits.
        out.extend_from_slice(&len[len.len() - 3..]);
        out.extend_from_slice(&[kind, f]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(chunk);
    }
}

/// The authority grpc-go sends for a bare socket-path target (its `encodeAuthority`): every
/// byte outside RFC 3986's unreserved and sub-delims characters and `:[]@` as `%XX`. This is
/// what the kubelet's plugin watcher sends on `plugins_registry/` sockets.
pub fn grpc_go_encoded_authority(target: &str) -> String {
    let mut out = String::with_capacity(target.len() * 3);
    for b in target.bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&b);
        if keep {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests;
