//! A bare HTTP/1.1 client for the tests and benchmarks (the status endpoints, creating a bucket
//! on the S3 server): one request, no body, read to the end.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `method path` (no body) on `addr`: the status code and the body.
pub fn http_request(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    // Chunked bodies: keep the chunks' data only.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut data = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            if size == 0 {
                break;
            }
            data.push_str(&tail[..size]);
            rest = &tail[size + 2..];
        }
        data
    } else {
        body.to_string()
    };
    (status, body)
}
