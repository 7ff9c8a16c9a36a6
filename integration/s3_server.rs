//! A real S3-compatible server for the tests and benchmarks: moto's server mode (installed by
//! `./test` from PyPI; it enforces `If-None-Match: *`, so conditional put is real), on a free
//! port on 127.0.0.1, its data in memory, killed when dropped. Shared with the storage
//! benchmark (`benches/storage.rs`); each uses part of it.

#![allow(dead_code)]

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use sluice::engine::object_store::aws::AmazonS3Builder;
use sluice::engine::object_store::path::Path as StorePath;
use sluice::engine::object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::http::http_request;

/// The server's secret key: a test checks it is never shown, in logs, `validate` output,
/// manifests or commitInfo.
pub const SECRET: &str = "sluice-test-secret-0d7c3e5a9b";

/// A moto S3 server on a free port, killed when dropped.
pub struct S3Server {
    child: Child,
    pub endpoint: String,
}

impl S3Server {
    /// Starts the server and creates `buckets`.
    pub fn start(buckets: &[&str]) -> S3Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m moto.server runs (./test installs moto[server])");
        let server = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto did not start on port {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        for bucket in buckets {
            server.create_bucket(bucket);
        }
        server
    }

    fn create_bucket(&self, bucket: &str) {
        let addr = self.endpoint.trim_start_matches("http://");
        let (status, body) = http_request(addr, "PUT", &format!("/{bucket}"));
        assert_eq!(status, 200, "creating bucket {bucket}: {body}");
    }

    /// The standard environment variables a job uses to reach the server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", "sluice-test".into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// The same settings as a job file's `storage_options` table (keys as object_store spells
    /// them), for a job that must not depend on its environment.
    pub fn storage_options(&self) -> String {
        format!(
            "aws_endpoint = \"{}\"\naws_access_key_id = \"sluice-test\"\n\
             aws_secret_access_key = \"{SECRET}\"\naws_region = \"us-east-1\"\n\
             aws_allow_http = \"true\"\n",
            self.endpoint
        )
    }

    /// A client of `bucket`, for the test's own uploads and downloads.
    pub fn bucket(&self, bucket: &str) -> Arc<dyn ObjectStore> {
        Arc::new(
            AmazonS3Builder::new()
                .with_endpoint(&self.endpoint)
                .with_allow_http(true)
                .with_bucket_name(bucket)
                .with_region("us-east-1")
                .with_access_key_id("sluice-test")
                .with_secret_access_key(SECRET)
                .build()
                .unwrap(),
        )
    }

    /// Uploads the files of the local folder `dir` to `bucket/prefix/`, except those already
    /// there (a file of a source is never rewritten).
    pub async fn upload(&self, dir: &Path, bucket: &str, prefix: &str) {
        let store = self.bucket(bucket);
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        for name in names {
            let path = StorePath::from(format!("{prefix}/{name}"));
            if store.head(&path).await.is_ok() {
                continue;
            }
            let bytes = std::fs::read(dir.join(&name)).unwrap();
            store.put(&path, PutPayload::from(bytes)).await.unwrap();
        }
    }

    /// Copies everything under `bucket/prefix/` into the local folder `dir` (so the local
    /// readers of the other tests can check what the job wrote to the store).
    pub async fn download(&self, bucket: &str, prefix: &str, dir: &Path) {
        let store = self.bucket(bucket);
        let listed: Vec<_> = store
            .list(Some(&StorePath::from(prefix)))
            .try_collect()
            .await
            .unwrap();
        for meta in listed {
            let rel = meta
                .location
                .as_ref()
                .strip_prefix(prefix)
                .unwrap()
                .trim_start_matches('/')
                .to_string();
            let target = dir.join(rel);
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            let bytes = store
                .get(&meta.location)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            std::fs::write(target, bytes).unwrap();
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) to the server: a stopped server accepts connections and
    /// answers nothing, as a store that hangs does.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} failed");
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
