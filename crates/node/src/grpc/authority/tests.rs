use super::*;

type Fields = Vec<(String, String)>;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len().to_be_bytes();
    let mut f = len[len.len() - 3..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn fields(list: &[(&str, &str)]) -> Fields {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// Feeds `input` to a rewriter `step` bytes at a time.
fn run(policy: Policy, input: &[u8], step: usize) -> Result<Vec<u8>, RewriteError> {
    let mut r = Rewriter::new(policy);
    let mut out = Vec::new();
    for piece in input.chunks(step) {
        r.push(piece, &mut out)?;
    }
    Ok(out)
}

/// The frames after the preface: (type, flags, stream, payload).
fn frames(out: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    assert!(out.starts_with(PREFACE), "preface passed first");
    let mut rest = &out[PREFACE.len()..];
    let mut list = Vec::new();
    while !rest.is_empty() {
        let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        list.push((rest[3], rest[4], stream, rest[9..9 + len].to_vec()));
        rest = &rest[9 + len..];
    }
    list
}

/// Every header list the server would decode from `out`, with one decoder as h2 has.
fn header_lists(out: &[u8]) -> Vec<(u32, Fields)> {
    let mut decoder = loona_hpack::Decoder::new();
    let mut lists = Vec::new();
    let mut block: Vec<u8> = Vec::new();
    for (kind, flags, stream, payload) in frames(out) {
        if kind != HEADERS && kind != CONTINUATION {
            continue;
        }
        let body = if kind == HEADERS && flags & PRIORITY != 0 {
            &payload[5..]
        } else {
            &payload[..]
        };
        block.extend_from_slice(body);
        if flags & END_HEADERS != 0 {
            let list = decoder.decode(&block).unwrap();
            lists.push((
                stream,
                list.into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect(),
            ));
            block.clear();
        }
    }
    lists
}

fn request(authority: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":scheme", "http".into()),
        (":path", "/pluginregistration.Registration/GetInfo".into()),
        (":authority", authority.into()),
        ("content-type", "application/grpc".into()),
        ("te", "trailers".into()),
    ]
}

/// A header block as grpc-go's encoder writes one: `:authority` with incremental indexing the
/// first time, then only as an index into the dynamic table (62: its one entry).
fn grpc_go_block(authority: &str, first: bool) -> Vec<u8> {
    let mut b = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    b.push(0x04); // :path, literal without indexing, static name
    encode_string(b"/pluginregistration.Registration/GetInfo", &mut b);
    if first {
        b.push(0x41); // :authority, literal with incremental indexing, static name
        encode_string(authority.as_bytes(), &mut b);
    } else {
        b.push(0x80 | 62);
    }
    b.push(0x0f); // content-type (31), literal without indexing
    b.push(31 - 15);
    encode_string(b"application/grpc", &mut b);
    encode_literal(b"te", b"trailers", &mut b);
    b
}

fn encoded_requests(authority: &str, n: u32) -> Vec<u8> {
    let mut input = PREFACE.to_vec();
    input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    for i in 0..n {
        let block = grpc_go_block(authority, i == 0);
        input.extend(frame(HEADERS, END_HEADERS, 2 * i + 1, &block));
        input.extend(frame(0x0, END_STREAM, 2 * i + 1, b"\0\0\0\0\0"));
    }
    input
}

#[test]
fn the_plugin_watchers_encoded_path_becomes_localhost_on_every_request() {
    let path = "/var/lib/kubelet/plugins_registry/gpu.gpuplane.dev-reg.sock";
    let encoded = grpc_go_encoded_authority(path);
    assert_eq!(
        encoded,
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.gpuplane.dev-reg.sock"
    );
    assert!(!valid_authority(encoded.as_bytes()), "h2 would reset this");
    let input = encoded_requests(&encoded, 3);
    let second_block = &frames(&input)[3].3;
    assert!(
        second_block.contains(&(0x80 | 62)) && !second_block.windows(3).any(|w| w == b"%2F"),
        "the second request refers to the dynamic table: {second_block:?}"
    );
    let out = run(Policy::Normalize, &input, usize::MAX).unwrap();
    let lists = header_lists(&out);
    assert_eq!(lists.len(), 3);
    for (i, (stream, list)) in lists.iter().enumerate() {
        assert_eq!(*stream, 2 * i as u32 + 1);
        let want: Fields = request("localhost")
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(list, &want);
    }
    // DATA and SETTINGS frames pass as they were.
    let kinds: Vec<u8> = frames(&out).iter().map(|f| f.0).collect();
    assert_eq!(kinds, [0x4, HEADERS, 0x0, HEADERS, 0x0, HEADERS, 0x0]);
    assert_eq!(frames(&out)[2], frames(&input)[2]);
}

#[test]
fn raw_path_and_empty_become_localhost_valid_and_absent_stay() {
    for (sent, seen) in [
        ("/var/lib/kubelet/plugins_registry/x-reg.sock", "localhost"),
        ("", "localhost"),
        ("localhost", "localhost"),
        ("127.0.0.1:80", "127.0.0.1:80"),
    ] {
        let out = run(Policy::Normalize, &encoded_requests(sent, 2), usize::MAX).unwrap();
        for (_, list) in header_lists(&out) {
            assert_eq!(
                list[3],
                (":authority".to_string(), seen.to_string()),
                "{sent:?}"
            );
        }
    }
    let mut enc = loona_hpack::Encoder::new();
    let block = enc.encode([(&b":method"[..], &b"POST"[..]), (b":path", b"/x")]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, &block));
    let out = run(Policy::Normalize, &input, usize::MAX).unwrap();
    assert_eq!(
        header_lists(&out),
        [(1, fields(&[(":method", "POST"), (":path", "/x")]))]
    );
    assert_eq!(frames(&out)[0].1, END_HEADERS | END_STREAM);
}

#[test]
fn any_split_of_the_stream_gives_the_same_bytes() {
    let input = encoded_requests("%2Fa%2Fb.sock", 2);
    let whole = run(Policy::Normalize, &input, usize::MAX).unwrap();
    for step in [1, 2, 3, 7, 9, 10, 24, 25, 64] {
        assert_eq!(
            run(Policy::Normalize, &input, step).unwrap(),
            whole,
            "step {step}"
        );
    }
}

#[test]
fn rfc7541_huffman_requests_decode_identically_after_rewriting() {
    // RFC 7541 C.4.1-C.4.3: three requests on one connection, Huffman-coded, the later ones
    // referring to dynamic-table entries the earlier ones added.
    let blocks = [
        "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
        "8286 84be 5886 a8eb 1064 9cbf",
        "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
    ];
    let mut input = PREFACE.to_vec();
    for (i, b) in blocks.iter().enumerate() {
        input.extend(frame(HEADERS, END_HEADERS, 2 * i as u32 + 1, &hex(b)));
    }
    let out = run(Policy::Normalize, &input, 5).unwrap();
    let lists: Vec<Fields> = header_lists(&out).into_iter().map(|l| l.1).collect();
    let first = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ];
    assert_eq!(lists[0], fields(&first));
    let mut second = first.to_vec();
    second.push(("cache-control", "no-cache"));
    assert_eq!(lists[1], fields(&second));
    assert_eq!(
        lists[2],
        fields(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ])
    );
}

#[test]
fn padding_priority_and_continuation_are_understood() {
    let mut enc = loona_hpack::Encoder::new();
    let req = request("%2Fs.sock");
    let block = enc.encode(req.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    let (a, b) = block.split_at(block.len() / 2);
    let mut payload = vec![3u8]; // pad length
    payload.extend_from_slice(&[0x80, 0, 0, 1, 200]); // exclusive dependency on 1, weight
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0, 0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 3, &payload));
    input.extend(frame(CONTINUATION, END_HEADERS, 3, b));
    let out = run(Policy::Normalize, &input, 4).unwrap();
    let f = frames(&out);
    assert_eq!(f.len(), 1, "one HEADERS frame with END_HEADERS");
    assert_eq!(f[0].1, PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(&f[0].3[..5], &[0x80, 0, 0, 1, 200]);
    assert_eq!(header_lists(&out)[0].1[3].1, "localhost");
}

#[test]
fn a_block_larger_than_a_frame_is_split_into_continuations() {
    let big = "v".repeat(40_000);
    let mut enc = loona_hpack::Encoder::new();
    let block = enc.encode([
        (&b":authority"[..], &b"%2Fs"[..]),
        (b"x-big", big.as_bytes()),
    ]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, END_HEADERS, 1, &block));
    let out = run(Policy::Normalize, &input, usize::MAX).unwrap();
    let kinds: Vec<(u8, u8)> = frames(&out).iter().map(|f| (f.0, f.1)).collect();
    assert_eq!(
        kinds,
        [(HEADERS, 0), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
    );
    assert!(frames(&out).iter().all(|f| f.3.len() <= MIN_MAX_FRAME_SIZE));
    assert_eq!(
        header_lists(&out)[0].1,
        fields(&[(":authority", "localhost"), ("x-big", &big)])
    );
}

#[test]
fn a_client_double_sends_exactly_the_authority_it_is_told() {
    let input = encoded_requests("localhost", 2);
    let encoded = grpc_go_encoded_authority("/run/x.sock");
    let out = run(Policy::Send(Some(encoded.clone().into_bytes())), &input, 3).unwrap();
    for (_, list) in header_lists(&out) {
        assert_eq!(list[3], (":authority".to_string(), encoded.clone()));
    }
    let out = run(Policy::Send(None), &input, usize::MAX).unwrap();
    for (_, list) in header_lists(&out) {
        assert!(list.iter().all(|(n, _)| n != ":authority"), "{list:?}");
        assert_eq!(list.len(), 5);
    }
}

#[test]
fn malformed_input_is_refused_or_left_to_h2() {
    // Not HTTP/2: passed as it is, so the server answers (or closes) by itself.
    let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(run(Policy::Normalize, http1, 4).unwrap(), http1);
    // A frame between HEADERS and its CONTINUATION.
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, 0, 1, &[0x82]));
    input.extend(frame(0x0, 0, 1, b"x"));
    assert_eq!(
        run(Policy::Normalize, &input, usize::MAX),
        Err(RewriteError::ContinuationExpected {
            stream: 1,
            frame_type: 0
        })
    );
    // Padding longer than the frame.
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82]));
    assert_eq!(
        run(Policy::Normalize, &input, usize::MAX),
        Err(RewriteError::BadHeadersFrame { stream: 1 })
    );
    // An index the table does not have.
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f]));
    assert!(matches!(
        run(Policy::Normalize, &input, usize::MAX),
        Err(RewriteError::Hpack { stream: 1, .. })
    ));
    // A header block that never ends is bounded.
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, 0, 1, &vec![0; 16_000]));
    for _ in 0..20 {
        input.extend(frame(CONTINUATION, 0, 1, &vec![0; 16_000]));
    }
    assert_eq!(
        run(Policy::Normalize, &input, usize::MAX),
        Err(RewriteError::BlockTooLarge { stream: 1 })
    );
}

/// Three requests as a client with an HPACK table would send them: `first` carries
/// `authority`, the second `%2Fs`, and the third only refers to entries the first two indexed.
fn indexed_requests(authority: &[u8]) -> Vec<u8> {
    let mut a = vec![0x83, 0x86, 0x84]; // POST, http, "/"
    a.push(0x41); // :authority, incremental indexing
    encode_string(authority, &mut a);
    a.push(0x40); // x-a: 1, incremental indexing, new name
    encode_string(b"x-a", &mut a);
    encode_string(b"1", &mut a);
    let mut b = vec![0x83, 0x86, 0x84];
    b.push(0x41);
    encode_string(b"%2Fs", &mut b);
    b.push(0x40);
    encode_string(b"x-b", &mut b);
    encode_string(b"2", &mut b);
    // The client's table now: 62 x-b, 63 :authority %2Fs, 64 x-a, 65 :authority <first>.
    let c = vec![0x83, 0x86, 0x84, 0x80 | 62, 0x80 | 64, 0x80 | 65];
    let mut input = PREFACE.to_vec();
    for (i, block) in [&a, &b, &c].into_iter().enumerate() {
        input.extend(frame(HEADERS, END_HEADERS, 2 * i as u32 + 1, block));
        input.extend(frame(0x0, END_STREAM, 2 * i as u32 + 1, b"grpc message"));
    }
    input
}

#[test]
fn a_connection_whose_first_authority_is_valid_passes_through_untouched() {
    for valid in [&b"localhost"[..], b"127.0.0.1:80"] {
        let input = indexed_requests(valid);
        for step in [1, 7, usize::MAX] {
            assert_eq!(
                run(Policy::Normalize, &input, step).unwrap(),
                input,
                "step {step}"
            );
        }
        // Once the first header block is through, no byte needs the rewriter.
        let first_end = PREFACE.len() + frames(&input)[0].3.len() + 9;
        let mut r = Rewriter::new(Policy::Normalize);
        let mut out = Vec::new();
        r.push(&input[..first_end - 1], &mut out).unwrap();
        assert!(!r.passes_through(), "decided before the block was whole");
        r.push(&input[first_end - 1..first_end + 5], &mut out)
            .unwrap();
        assert!(r.passes_through());
        assert_eq!(out, input[..first_end + 5]);
    }
}

#[test]
fn after_a_rewritten_first_request_every_block_is_re_encoded() {
    let input = indexed_requests(b"/var/lib/kubelet/plugins_registry/x.sock");
    let mut r = Rewriter::new(Policy::Normalize);
    let mut out = Vec::new();
    r.push(&input, &mut out).unwrap();
    assert!(!r.passes_through());
    let lists: Vec<Fields> = header_lists(&out).into_iter().map(|l| l.1).collect();
    let head = [(":method", "POST"), (":scheme", "http"), (":path", "/")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = head.to_vec();
        v.extend_from_slice(extra);
        fields(&v)
    };
    assert_eq!(lists[0], with(&[(":authority", "localhost"), ("x-a", "1")]));
    assert_eq!(lists[1], with(&[(":authority", "localhost"), ("x-b", "2")]));
    // The third refers to entries the server never saw indexed: it must have been re-encoded.
    assert_eq!(
        lists[2],
        with(&[("x-b", "2"), ("x-a", "1"), (":authority", "localhost")])
    );
    // DATA frames pass as they were.
    let data: Vec<Vec<u8>> = frames(&out)
        .into_iter()
        .filter(|f| f.0 == 0)
        .map(|f| f.3)
        .collect();
    assert_eq!(data, vec![b"grpc message".to_vec(); 3]);
}
