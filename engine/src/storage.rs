//! Object storage: where a location's bytes live (a local disk, S3, GCS or Azure), how a
//! location is configured, and how Sluice rides out a store that is briefly down.
//!
//! Every location a job names — a files source's folder, the Delta tables, the checkpoint — is
//! opened by [`open_store`], so a URL means the same thing everywhere.
//!
//! **Configuration** is the way users already give it: the standard environment variables
//! (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `AWS_ALLOW_HTTP`, …; `GOOGLE_SERVICE_ACCOUNT`, …; `AZURE_STORAGE_ACCOUNT_NAME`, …), overridden
//! per location by [`StorageOptions`] (a job file's `storage_options` table), whose keys are
//! spelled as object_store and delta-rs spell them (`aws_endpoint`, `aws_region`,
//! `google_service_account`, `azure_storage_account_name`, …). An unknown key is an error naming
//! it. Option values are never printed: [`StorageOptions`]' `Debug` shows keys only.
//!
//! **Transient errors** (timeouts, 5xx such as S3's 503 SlowDown, 429, a refused or reset
//! connection) are retried: object_store retries a request itself for a short while, and
//! [`PatientStore`] keeps retrying with backoff — logging each attempt — for up to the job's
//! `store_unavailable_timeout` (default 10 min) before the operation fails with
//! [`StoreUnavailable`]. A write that must not overwrite (`PutMode::Create`) may have landed on
//! an attempt that seemed to fail: when it finds the object present with exactly the bytes it
//! is writing, the write counts as its own. (Two writers racing with the same bytes both
//! succeed: the writes that claim something — a lease epoch, a backfill number — carry
//! their writer's pid and clock.)
//!
//! **Conditional put.** Delta commits and the checkpoint's intents, manifests and lease are
//! written put-if-absent; there is no lock service and no "unsafe rename" mode. A store that
//! cannot do that is refused when the job starts ([`check_conditional_put`]).

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, ObjectStoreExt, ObjectStoreScheme, PutMode, PutMultipartOptions, PutOptions,
    PutPayload, PutResult,
};
use tracing::warn;
use url::Url;

use crate::error::{Error, Result};

/// How long a store may stay unreachable before the job stops (`[job] store_unavailable_timeout`).
pub const DEFAULT_UNAVAILABLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// How long a store may stay unreachable when a job starts (its conditional-put probe) before
/// the start fails: a typo in an endpoint, or missing credentials, fails in seconds, not after
/// the job's `store_unavailable_timeout`.
pub const START_UNAVAILABLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Per-location settings of an object store: option keys as object_store spells them, and how
/// long the store may stay unreachable. `Debug` shows the keys, never the values (they hold
/// secrets).
#[derive(Clone, PartialEq, Eq)]
pub struct StorageOptions {
    options: BTreeMap<String, String>,
    unavailable_timeout: Duration,
}

impl Default for StorageOptions {
    fn default() -> Self {
        StorageOptions {
            options: BTreeMap::new(),
            unavailable_timeout: DEFAULT_UNAVAILABLE_TIMEOUT,
        }
    }
}

impl fmt::Debug for StorageOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageOptions")
            .field("keys", &self.options.keys().collect::<Vec<_>>())
            .field("unavailable_timeout", &self.unavailable_timeout)
            .finish()
    }
}

impl StorageOptions {
    /// Options from `key = value` pairs (keys are matched case-insensitively; see
    /// [`StorageOptions::from_map`]).
    pub fn new(options: impl IntoIterator<Item = (String, String)>) -> Self {
        let options: Vec<(String, String)> = options.into_iter().collect();
        StorageOptions::from_map(options.iter().map(|(k, v)| (k, v)))
    }

    /// The same options with another unavailable timeout.
    #[must_use]
    pub fn with_unavailable_timeout(mut self, timeout: Duration) -> Self {
        self.unavailable_timeout = timeout;
        self
    }

    /// How long the store may stay unreachable before an operation fails.
    pub fn unavailable_timeout(&self) -> Duration {
        self.unavailable_timeout
    }

    /// Whether no option is set.
    pub fn is_empty(&self) -> bool {
        self.options.is_empty()
    }

    /// The options and the timeout as one map, for delta-rs to hand back to the store factory
    /// (see [`StorageOptions::from_map`]).
    pub fn to_map(&self) -> std::collections::HashMap<String, String> {
        let mut map: std::collections::HashMap<String, String> = self
            .options
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        map.insert(
            Self::UNAVAILABLE_TIMEOUT_KEY.into(),
            self.unavailable_timeout.as_millis().to_string(),
        );
        map
    }

    /// Reads back a map made by [`StorageOptions::to_map`] (or a job file's `storage_options`
    /// table, with the timeout the job file added to it).
    pub fn from_map<'a>(map: impl IntoIterator<Item = (&'a String, &'a String)>) -> Self {
        let mut options = StorageOptions::default();
        for (key, value) in map {
            let key = key.to_ascii_lowercase();
            if key == Self::UNAVAILABLE_TIMEOUT_KEY {
                if let Ok(ms) = value.parse() {
                    options.unavailable_timeout = Duration::from_millis(ms);
                }
            } else {
                options.options.insert(key, value.clone());
            }
        }
        options
    }

    /// The key under which the unavailable timeout (in milliseconds) travels with the options:
    /// from a job file's `storage_options` table, and through delta-rs back to Sluice's store
    /// factory ([`StorageOptions::to_map`]).
    pub const UNAVAILABLE_TIMEOUT_KEY: &'static str = "sluice_store_unavailable_timeout_ms";
}

impl<'de> serde::Deserialize<'de> for StorageOptions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let map = BTreeMap::<String, String>::deserialize(d)?;
        Ok(StorageOptions::from_map(&map))
    }
}

/// Opens the object store holding `url`, configured from the environment and `options`; returns
/// it with the path of `url` inside it. Cloud stores come wrapped in a [`PatientStore`].
///
/// # Errors
/// [`Error::InvalidJob`] naming the URL if its scheme is not one this build has (file and
/// memory always; s3, s3a with the `s3` feature; gs with `gcs`; az, abfs, abfss, azure, adl
/// with `azure`), or naming an option key the store does not know.
pub fn open_store(url: &Url, options: &StorageOptions) -> Result<(Arc<dyn ObjectStore>, Path)> {
    let unsupported = |e: &dyn fmt::Display| {
        Error::InvalidJob(format!(
            "location {url} is not supported: {e} (this build reads and writes local paths and \
             {} URLs)",
            schemes_in_words()
        ))
    };
    if !supported_schemes().contains(&url.scheme()) {
        return Err(
            match CLOUD_STORES.iter().find(|s| s.scheme == url.scheme()) {
                Some(store) => Error::StoreNotBuilt {
                    location: url.to_string(),
                    feature: store.feature.to_string(),
                    schemes: schemes_in_words(),
                },
                None => unsupported(&format!("scheme '{}'", url.scheme())),
            },
        );
    }
    let (scheme, path) = ObjectStoreScheme::parse(url).map_err(|e| unsupported(&e))?;
    let path = Path::parse(path).map_err(|e| unsupported(&e))?;
    #[cfg_attr(
        not(any(feature = "s3", feature = "gcs", feature = "azure")),
        allow(unused_variables)
    )]
    let invalid = |e: object_store::Error| {
        Error::InvalidJob(format!("location {url}: the store cannot be set up: {e}"))
    };
    #[cfg_attr(
        not(any(feature = "s3", feature = "gcs", feature = "azure")),
        allow(unused_variables)
    )]
    let unknown_key = |key: &str, store: &str| {
        Error::InvalidJob(format!(
            "location {url}: storage option '{key}' is not a {store} option (keys are spelled as \
             object_store spells them, e.g. aws_endpoint, aws_region, google_service_account, \
             azure_storage_account_name)"
        ))
    };
    match scheme {
        ObjectStoreScheme::Local | ObjectStoreScheme::Memory => {
            if let Some(key) = options.options.keys().next() {
                return Err(Error::InvalidJob(format!(
                    "location {url}: storage option '{key}' applies to object stores, not to a \
                     local path"
                )));
            }
            let (store, _) = object_store::parse_url(url).map_err(|e| unsupported(&e))?;
            Ok((Arc::from(store), path))
        }
        #[cfg(feature = "s3")]
        ObjectStoreScheme::AmazonS3 => {
            use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
            let mut builder = AmazonS3Builder::from_env().with_url(url.as_str());
            for (key, value) in &options.options {
                let key: AmazonS3ConfigKey = key.parse().map_err(|_| unknown_key(key, "S3"))?;
                builder = builder.with_config(key, value);
            }
            let store = builder
                .with_retry(retry_config(options.unavailable_timeout))
                .build()
                .map_err(invalid)?;
            Ok((patient(Arc::new(store), url, options), path))
        }
        #[cfg(feature = "gcs")]
        ObjectStoreScheme::GoogleCloudStorage => {
            use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
            let mut builder = GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
            for (key, value) in &options.options {
                let key: GoogleConfigKey = key.parse().map_err(|_| unknown_key(key, "GCS"))?;
                builder = builder.with_config(key, value);
            }
            let store = builder
                .with_retry(retry_config(options.unavailable_timeout))
                .build()
                .map_err(invalid)?;
            Ok((patient(Arc::new(store), url, options), path))
        }
        #[cfg(feature = "azure")]
        ObjectStoreScheme::MicrosoftAzure => {
            use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
            let mut builder = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            for (key, value) in &options.options {
                let key: AzureConfigKey = key.parse().map_err(|_| unknown_key(key, "Azure"))?;
                builder = builder.with_config(key, value);
            }
            let store = builder
                .with_retry(retry_config(options.unavailable_timeout))
                .build()
                .map_err(invalid)?;
            Ok((patient(Arc::new(store), url, options), path))
        }
        other => Err(unsupported(&format!("{other:?} is not built in"))),
    }
}

/// A cloud store wrapped in a [`PatientStore`].
#[cfg_attr(
    not(any(feature = "s3", feature = "gcs", feature = "azure")),
    allow(dead_code)
)]
fn patient(
    inner: Arc<dyn ObjectStore>,
    url: &Url,
    options: &StorageOptions,
) -> Arc<dyn ObjectStore> {
    Arc::new(PatientStore {
        inner,
        url: url.clone(),
        timeout: options.unavailable_timeout,
    })
}

/// The schemes of this build as `file://, memory://, s3://, …`, for messages.
fn schemes_in_words() -> String {
    supported_schemes()
        .iter()
        .map(|s| format!("{s}://"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A URL scheme of a cloud store: the cargo feature that builds its store, and whether this
/// build has it.
struct CloudScheme {
    scheme: &'static str,
    feature: &'static str,
    built: bool,
}

const fn cloud(scheme: &'static str, feature: &'static str, built: bool) -> CloudScheme {
    CloudScheme {
        scheme,
        feature,
        built,
    }
}

/// The URL schemes of the cloud stores.
const CLOUD_STORES: [CloudScheme; 8] = [
    cloud("s3", "s3", cfg!(feature = "s3")),
    cloud("s3a", "s3", cfg!(feature = "s3")),
    cloud("gs", "gcs", cfg!(feature = "gcs")),
    cloud("az", "azure", cfg!(feature = "azure")),
    cloud("abfs", "azure", cfg!(feature = "azure")),
    cloud("abfss", "azure", cfg!(feature = "azure")),
    cloud("azure", "azure", cfg!(feature = "azure")),
    cloud("adl", "azure", cfg!(feature = "azure")),
];

/// The URL schemes [`open_store`] opens in this build.
pub fn supported_schemes() -> Vec<&'static str> {
    let built = CLOUD_STORES.iter().filter(|s| s.built).map(|s| s.scheme);
    ["file", "memory"].into_iter().chain(built).collect()
}

/// object_store's own retries of one request (each logged by object_store at info): its
/// defaults (10 retries within 3 min), never past `unavailable`. They also cover what
/// [`PatientStore`] cannot retry whole: the parts and the completion of a multipart upload (a
/// data file above 5 MiB); [`PatientStore`] waits longer for everything else.
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
fn retry_config(unavailable: Duration) -> object_store::RetryConfig {
    let default = object_store::RetryConfig::default();
    object_store::RetryConfig {
        retry_timeout: default.retry_timeout.min(unavailable),
        ..default
    }
}

/// Checks that the store at `url` refuses to overwrite an object written with
/// `PutMode::Create`, by writing a probe object under `prefix` twice (then deleting it). Local
/// disks are not probed: they always can.
///
/// # Errors
/// [`Error::InvalidJob`] saying the store does not support conditional put; store errors.
pub async fn check_conditional_put(
    store: &dyn ObjectStore,
    prefix: &Path,
    url: &Url,
) -> Result<()> {
    if matches!(url.scheme(), "file" | "memory") {
        return Ok(());
    }
    let probe = prefix.clone().join(format!(
        "_sluice_conditional_put_probe_{}_{}",
        std::process::id(),
        chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
    ));
    let create = PutOptions::from(PutMode::Create);
    let refused = |detail: String| {
        Error::InvalidJob(format!(
            "the object store at {url} does not support conditional put ({detail}). Sluice \
             commits Delta versions and checkpoint files with a put-if-absent (PutMode::Create, \
             If-None-Match: *) and has no lock service or unsafe-rename mode: use a store that \
             enforces it (AWS S3, MinIO, Cloudflare R2, GCS, Azure, moto >= 5.2.1)"
        ))
    };
    match store
        .put_opts(&probe, PutPayload::from_static(b"1"), create.clone())
        .await
    {
        Ok(_) => {}
        Err(object_store::Error::NotImplemented { .. }) => {
            return Err(refused("the client refuses PutMode::Create".into()));
        }
        Err(e) => return Err(e.into()),
    }
    let second = store
        .put_opts(&probe, PutPayload::from_static(b"2"), create)
        .await;
    let _ = store.delete(&probe).await;
    match second {
        Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
        Ok(_) => Err(refused(
            "a second put-if-absent of the same object overwrote it".into(),
        )),
        Err(e) => Err(e.into()),
    }
}

/// The error of an operation on a store that stayed unreachable past the job's
/// `store_unavailable_timeout`.
#[derive(Debug, thiserror::Error)]
#[error(
    "the object store at {url} was unreachable for {waited:.0?} ({operation} {path}), past \
     store_unavailable_timeout ({timeout:?}); the last error: {last}. The job stops here; a \
     restart continues from its last commit"
)]
pub struct StoreUnavailable {
    url: String,
    operation: &'static str,
    path: String,
    waited: Duration,
    timeout: Duration,
    last: String,
}

/// A cloud store that waits out transient errors for up to its timeout (see the module docs).
pub struct PatientStore {
    inner: Arc<dyn ObjectStore>,
    url: Url,
    timeout: Duration,
}

/// The URL and timeout only: the inner clients' `Debug` can show credentials (Azure keys, GCS
/// tokens).
impl fmt::Debug for PatientStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PatientStore")
            .field("url", &self.url.as_str())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl fmt::Display for PatientStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PatientStore({})", self.inner)
    }
}

/// Whether `error` says the store could not be reached or was briefly overloaded (as opposed to
/// a refusal that will not change: not found, forbidden, already exists).
pub fn is_transient(error: &object_store::Error) -> bool {
    let object_store::Error::Generic { source, .. } = error else {
        return false;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(e) = cause {
        if e.is::<StoreUnavailable>() {
            return false;
        }
        if e.is::<Retry>() {
            return true;
        }
        // object_store's HTTP client exists in builds with a cloud store.
        #[cfg(any(feature = "s3", feature = "gcs", feature = "azure"))]
        if e.is::<object_store::client::HttpError>() {
            return true;
        }
        let text = e.to_string();
        // S3 answers some failures (SlowDown, InternalError) with 200 and an error body.
        if text.starts_with("Server returned error response:") {
            return true;
        }
        if let Some(rest) = text.split("non-2xx status code: ").nth(1) {
            let status = rest.get(..3).unwrap_or("");
            if status.starts_with('5') || status == "429" || status == "408" {
                return true;
            }
        }
        cause = e.source();
    }
    false
}

impl PatientStore {
    /// Runs `attempt` until it succeeds, fails for good, or the store has been unreachable for
    /// the timeout.
    async fn patiently<T, F, Fut>(
        &self,
        operation: &'static str,
        path: &Path,
        mut attempt: F,
    ) -> object_store::Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = object_store::Result<T>>,
    {
        let started = Instant::now();
        let mut pause = Duration::from_millis(200);
        let mut tries = 0u32;
        loop {
            match attempt().await {
                Err(error) if is_transient(&error) => {
                    tries += 1;
                    let waited = started.elapsed();
                    if waited >= self.timeout {
                        return Err(object_store::Error::Generic {
                            store: "sluice",
                            source: Box::new(StoreUnavailable {
                                url: self.url.to_string(),
                                operation,
                                path: path.to_string(),
                                waited,
                                timeout: self.timeout,
                                last: error.to_string(),
                            }),
                        });
                    }
                    warn!(store = %self.url, operation, %path, tries, waited_s = waited.as_secs_f64(), %error, "object store unavailable; retrying");
                    tokio::time::sleep(pause.min(self.timeout.saturating_sub(waited))).await;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                other => return other,
            }
        }
    }
}

/// A transient error of Sluice's own making: retried like a store's.
fn transient(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "sluice",
        source: Box::new(Retry(what.to_string())),
    }
}

/// The source of [`transient`]'s errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Retry(String);

/// Whether `payload` holds exactly `bytes`.
fn same_bytes(payload: &PutPayload, bytes: &Bytes) -> bool {
    payload.content_length() == bytes.len()
        && payload
            .iter()
            .scan(0, |at, chunk| {
                let start = *at;
                *at += chunk.len();
                Some(bytes.get(start..*at) == Some(chunk.as_ref()))
            })
            .all(|same| same)
}

#[async_trait::async_trait]
impl ObjectStore for PatientStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let create = matches!(opts.mode, PutMode::Create);
        self.patiently("put", location, || {
            let (payload, opts) = (payload.clone(), opts.clone());
            async move {
                match self.inner.put_opts(location, payload.clone(), opts).await {
                    // An earlier attempt that seemed to fail (a timeout, a 5xx retried by
                    // object_store or by us) may have landed: the object holding exactly these
                    // bytes is this write.
                    Err(e @ object_store::Error::AlreadyExists { .. }) if create => {
                        match self.inner.get(location).await {
                            Ok(got) => {
                                let (e_tag, version) =
                                    (got.meta.e_tag.clone(), got.meta.version.clone());
                                if same_bytes(&payload, &got.bytes().await?) {
                                    Ok(PutResult { e_tag, version })
                                } else {
                                    Err(e)
                                }
                            }
                            // A conflicting write in progress (S3's 409) that did not land:
                            // try again.
                            Err(object_store::Error::NotFound { .. }) => Err(transient(
                                "put-if-absent met a conflicting write that did not land",
                            )),
                            Err(other) => Err(other),
                        }
                    }
                    other => other,
                }
            }
        })
        .await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.patiently("start upload", location, || {
            self.inner.put_multipart_opts(location, opts.clone())
        })
        .await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        // The body is read inside the retry, so a connection lost mid-body is retried too.
        self.patiently("get", location, || {
            let options = options.clone();
            async move {
                let got = self.inner.get_opts(location, options).await?;
                let (meta, range, attributes) =
                    (got.meta.clone(), got.range.clone(), got.attributes.clone());
                let bytes = got.bytes().await?;
                Ok(GetResult {
                    payload: GetResultPayload::Stream(
                        futures::stream::once(async move { Ok(bytes) }).boxed(),
                    ),
                    meta,
                    range,
                    attributes,
                })
            }
        })
        .await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.patiently("get ranges", location, || {
            self.inner.get_ranges(location, ranges)
        })
        .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        // In chunks of the stores' bulk-delete size, each chunk retried whole (deleting is
        // idempotent).
        let store = self.clone_handle();
        locations
            .try_chunks(1000)
            .map_err(|e| e.1)
            .and_then(move |chunk| {
                let store = store.clone_handle();
                async move {
                    let first = chunk.first().cloned().unwrap_or_default();
                    store
                        .patiently("delete", &first, || {
                            let paths = futures::stream::iter(chunk.clone().into_iter().map(Ok));
                            // A path deleted by an earlier attempt of this chunk is gone: done.
                            store
                                .inner
                                .delete_stream(paths.boxed())
                                .map(|deleted| match deleted {
                                    Err(object_store::Error::NotFound { path, .. }) => {
                                        Ok(Path::from(path))
                                    }
                                    other => other,
                                })
                                .try_collect::<Vec<_>>()
                        })
                        .await
                }
            })
            .map_ok(|deleted| futures::stream::iter(deleted.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.list_patiently(prefix, None)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.list_patiently(prefix, Some(offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        let at = prefix.cloned().unwrap_or_default();
        self.patiently("list", &at, || self.inner.list_with_delimiter(prefix))
            .await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.patiently("copy", from, || {
            self.inner.copy_opts(from, to, options.clone())
        })
        .await
    }
}

impl PatientStore {
    /// Another handle on the same store.
    fn clone_handle(&self) -> PatientStore {
        PatientStore {
            inner: Arc::clone(&self.inner),
            url: self.url.clone(),
            timeout: self.timeout,
        }
    }

    /// A listing, retried whole: collected before it is handed out, so a listing cut off
    /// halfway is started again rather than returned short.
    fn list_patiently(
        &self,
        prefix: Option<&Path>,
        offset: Option<&Path>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let store = self.clone_handle();
        let (prefix, offset) = (prefix.cloned(), offset.cloned());
        futures::stream::once(async move {
            let at = prefix.clone().unwrap_or_default();
            store
                .patiently("list", &at, || {
                    let listing = match &offset {
                        Some(offset) => store.inner.list_with_offset(prefix.as_ref(), offset),
                        None => store.inner.list(prefix.as_ref()),
                    };
                    listing.try_collect::<Vec<_>>()
                })
                .await
        })
        .map_ok(|metas| futures::stream::iter(metas.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }
}

/// The body of `got`, read whole — what `GetResult::bytes` does, but a local file is read
/// straight into a buffer of its size (object_store 0.13 zero-fills its buffer first). For a
/// file that may be rewritten in place (a files table's); [`read_immutable_body`] for one that
/// never is.
pub async fn read_body(got: GetResult) -> object_store::Result<Bytes> {
    read_whole(got, false).await
}

/// The body of a file that is complete and never rewritten in place (Delta's data files, a
/// files source's inputs), read whole: as [`read_body`], but a local file of at least
/// [`MAPPED_READ_BYTES`] on a local disk is mapped (`map_file_range`), not copied.
///
/// The kernel's copy of the files out of the page cache was a third of a JSON filter job's CPU
/// (`perf` of the Nexmark JSON bids, q2); a mapping costs a page-table entry per page instead.
/// Its price: while the bytes (or rows decoded into views of them) are in use, a file truncated
/// ends the process with `SIGBUS` rather than an error, and one rewritten in place changes
/// them under the reader — which the files read here may not do (see `map_file_range`).
pub async fn read_immutable_body(got: GetResult) -> object_store::Result<Bytes> {
    read_whole(got, true).await
}

/// [`read_body`], or [`read_immutable_body`] with `may_map`.
async fn read_whole(got: GetResult, may_map: bool) -> object_store::Result<Bytes> {
    let GetResult {
        payload,
        meta,
        range,
        attributes,
    } = got;
    match payload {
        GetResultPayload::File(file, path) => tokio::task::spawn_blocking(move || {
            read_file_range(file, &path, range, may_map).map_err(|source| {
                object_store::Error::Generic {
                    store: "LocalFileSystem",
                    source: format!("cannot read {}: {source}", path.display()).into(),
                }
            })
        })
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "LocalFileSystem",
            source: Box::new(e),
        })?,
        payload => {
            let got = GetResult {
                payload,
                meta,
                range,
                attributes,
            };
            got.bytes().await
        }
    }
}

/// Local reads of at least this many bytes are mapped (`map_file_range`); smaller ones are
/// copied, where a mapping's system calls and page-table work would cost more than the copy.
pub const MAPPED_READ_BYTES: u64 = 1024 * 1024;

/// `range` of `file`: with `may_map`, mapped from [`MAPPED_READ_BYTES`] on a local disk
/// ([`on_local_disk`]; read after all if the mapping fails), read into a buffer of its size
/// otherwise. Fewer bytes than the range is an error: the file shrank after it was opened.
fn read_file_range(
    mut file: std::fs::File,
    path: &std::path::Path,
    range: Range<u64>,
    may_map: bool,
) -> std::io::Result<Bytes> {
    use std::io::{Read, Seek, SeekFrom};
    let len = range.end.saturating_sub(range.start);
    let shrank = |got: u64| {
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "{got} bytes from offset {} where {len} were expected: the file shrank",
                range.start
            ),
        )
    };
    if may_map && len >= MAPPED_READ_BYTES && on_local_disk(&file) {
        let size = file.metadata()?.len();
        if size < range.end {
            return Err(shrank(size.saturating_sub(range.start)));
        }
        match map_file_range(&file, range.clone()) {
            Ok(bytes) => return Ok(bytes),
            // Refused (the process's mappings at `vm.max_map_count`, say): read as any file.
            Err(error) => warn!(
                path = %path.display(),
                %error,
                "cannot map a file to read it; reading it instead"
            ),
        }
    }
    let mut buf = Vec::with_capacity(usize::try_from(len).map_err(std::io::Error::other)?);
    file.seek(SeekFrom::Start(range.start))?;
    file.take(len).read_to_end(&mut buf)?;
    if buf.len() as u64 != len {
        return Err(shrank(buf.len() as u64));
    }
    Ok(Bytes::from(buf))
}

/// Whether `file` is on a local disk's filesystem — ext2/3/4, XFS, Btrfs, tmpfs, overlayfs,
/// ZFS, F2FS (Linux) — whose pages a mapping may rely on. A network or FUSE filesystem (NFS,
/// SMB, a bucket mounted with FUSE), any other, and other systems are read instead: their I/O
/// errors would reach a mapped read as `SIGBUS`, not as an error to report or retry.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn on_local_disk(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    /// The `f_type` magic numbers of those filesystems (`statfs(2)`; 32 bits).
    const LOCAL_DISK: [u32; 7] = [
        0xEF53,      // ext2, ext3, ext4
        0x5846_5342, // XFS
        0x9123_683E, // Btrfs
        0x0102_1994, // tmpfs
        0x794C_7630, // overlayfs (containers)
        0x2FC1_2FC1, // ZFS
        0xF2F5_2010, // F2FS
    ];
    let mut stats = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `fstatfs` reads only the open descriptor and writes a whole `statfs` to the
    // pointer on success; the value is read only then.
    let ok = unsafe { libc::fstatfs(file.as_raw_fd(), stats.as_mut_ptr()) } == 0;
    ok && {
        // SAFETY: initialised by the successful call above.
        let stats = unsafe { stats.assume_init() };
        // `f_type`'s width and sign differ between C libraries and targets; the magic numbers
        // are its low 32 bits.
        #[allow(clippy::unnecessary_cast)]
        let magic = stats.f_type as u32;
        LOCAL_DISK.contains(&magic)
    }
}

/// Other systems read every file ([`read_file_range`]).
#[cfg(not(target_os = "linux"))]
fn on_local_disk(_: &std::fs::File) -> bool {
    false
}

/// Not reached: [`on_local_disk`] says no on other systems.
#[cfg(not(target_os = "linux"))]
fn map_file_range(_: &std::fs::File, _: Range<u64>) -> std::io::Result<Bytes> {
    Err(std::io::Error::other("files are mapped on Linux only"))
}

/// `range` of `file` (which holds it), mapped read-only with its pages mapped in at once
/// (`MAP_POPULATE`: the page cache's pages are entered in the page table by this read, on its
/// blocking thread, not faulted in one by one by the decoder), unmapped when the last slice of
/// the bytes is dropped.
///
/// A mapping reads what the file holds when a page is touched, so a file truncated while its
/// bytes are still in use ends the process with `SIGBUS` (an I/O error of the disk does too:
/// `MAP_POPULATE` ignores one) instead of returning an error, and a rewrite in place changes
/// them: only files that are complete and never rewritten are mapped
/// ([`read_immutable_body`]) — Delta's data files, and a files source's inputs, which its
/// contract says must not change once written (one that does is an error naming it when it
/// is next read, after the restart).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn map_file_range(file: &std::fs::File, range: Range<u64>) -> std::io::Result<Bytes> {
    let len = usize::try_from(range.end - range.start).map_err(std::io::Error::other)?;
    // SAFETY: the mapping is read-only and `Bytes` hands out only shared references to it,
    // so this process never writes it. Another process could (truncate or rewrite the file in
    // place) — the caveat above: callers map only files that are complete and never
    // rewritten.
    let mapped = unsafe {
        memmap2::MmapOptions::new()
            .offset(range.start)
            .len(len)
            .populate()
            .map(file)?
    };
    Ok(Bytes::from_owner(mapped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_never_print_their_values() {
        let options = StorageOptions::new([
            ("AWS_SECRET_ACCESS_KEY".to_string(), "hunter2".to_string()),
            ("aws_region".to_string(), "eu-west-1".to_string()),
        ]);
        let shown = format!("{options:?}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("eu-west-1"),
            "{shown}"
        );
        let back = StorageOptions::from_map(
            options
                .clone()
                .with_unavailable_timeout(Duration::from_secs(3))
                .to_map()
                .iter(),
        );
        assert_eq!(back.unavailable_timeout(), Duration::from_secs(3));
        assert_eq!(back.options, options.options);
    }

    #[test]
    fn a_bad_scheme_or_option_key_is_named() {
        let url = Url::parse("ftp://host/x/").unwrap();
        let err = open_store(&url, &StorageOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("ftp://host/x/"), "{err}");
        let options = StorageOptions::new([("aws_endpoit".to_string(), "x".to_string())]);
        if cfg!(feature = "s3") {
            let url = Url::parse("s3://bucket/x/").unwrap();
            let err = open_store(&url, &options).unwrap_err().to_string();
            assert!(err.contains("'aws_endpoit'"), "{err}");
        }
        let local = Url::parse("file:///tmp/x/").unwrap();
        let err = open_store(&local, &options).unwrap_err().to_string();
        assert!(err.contains("local path"), "{err}");
    }

    /// A cloud location opens in a build with its store's feature, and is refused naming the
    /// feature in one without.
    #[test]
    fn a_cloud_location_needs_its_feature() {
        for CloudScheme {
            scheme,
            feature,
            built,
        } in CLOUD_STORES
        {
            let url = Url::parse(&format!("{scheme}://bucket/x/")).unwrap();
            assert_eq!(built, supported_schemes().contains(&scheme));
            match open_store(&url, &StorageOptions::default()) {
                Err(e) if !built => {
                    let message = e.to_string();
                    assert!(
                        message.contains(&format!("`{feature}` feature")),
                        "{message}"
                    );
                    assert!(message.contains(url.as_str()), "{message}");
                }
                Err(e) => {
                    // Built in: a refusal may only be about the store's settings.
                    let message = e.to_string();
                    assert!(!message.contains("feature"), "{scheme}: {message}");
                }
                Ok(_) => assert!(built, "{scheme} opened without its feature"),
            }
        }
    }

    /// A local file's body, whole or a range, read as `GetResult::bytes` reads it; a stream's
    /// too; a file that shrank after it was opened is an error, not short bytes.
    #[tokio::test]
    async fn bodies_read_whole_and_in_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let local = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let path = Path::from("a/b.json");
        local.put(&path, data.clone().into()).await.unwrap();
        let whole = read_body(local.get(&path).await.unwrap()).await.unwrap();
        assert_eq!(whole, data);
        let ranged = local
            .get_opts(&path, GetOptions::new().with_range(Some(1000..5000u64)))
            .await
            .unwrap();
        assert!(matches!(ranged.payload, GetResultPayload::File(..)));
        assert_eq!(read_body(ranged).await.unwrap(), data[1000..5000]);
        let memory = object_store::memory::InMemory::new();
        memory.put(&path, data.clone().into()).await.unwrap();
        assert_eq!(
            read_body(memory.get(&path).await.unwrap()).await.unwrap(),
            data
        );
        let opened = local.get(&path).await.unwrap();
        std::fs::write(dir.path().join("a/b.json"), &data[..10]).unwrap();
        let error = read_body(opened).await.unwrap_err().to_string();
        assert!(error.contains("the file shrank"), "{error}");
    }

    /// A file large enough to be mapped reads as one read into a buffer does: whole, from an
    /// offset that is not a page's, and a file that shrank after it was opened is an error.
    #[tokio::test]
    async fn large_bodies_are_mapped_and_read_alike() {
        let dir = tempfile::tempdir().unwrap();
        let local = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
        let len = usize::try_from(MAPPED_READ_BYTES).unwrap() * 3 + 123;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let path = Path::from("big.json");
        local.put(&path, data.clone().into()).await.unwrap();
        let file = std::fs::File::open(dir.path().join("big.json")).unwrap();
        #[cfg(target_os = "linux")]
        assert!(
            on_local_disk(&file),
            "the temporary directory is not on a local disk's filesystem: the mapped path \
             is not tested (set TMPDIR)"
        );
        // `read_body` copies, `read_immutable_body` maps: the mapping is there while the bytes
        // are.
        for may_map in [false, true] {
            let got = local.get(&path).await.unwrap();
            let bytes = read_whole(got, may_map).await.unwrap();
            assert_eq!(bytes, data);
            #[cfg(target_os = "linux")]
            {
                let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
                let name = dir.path().join("big.json").display().to_string();
                assert_eq!(maps.contains(&name), may_map, "{maps}");
            }
        }
        let range = 4097..(len as u64 - 5);
        let expected = &data[4097..len - 5];
        for may_map in [false, true] {
            let ranged = local
                .get_opts(&path, GetOptions::new().with_range(Some(range.clone())))
                .await
                .unwrap();
            assert_eq!(read_whole(ranged, may_map).await.unwrap(), expected);
        }
        #[cfg(target_os = "linux")]
        {
            let mapped = map_file_range(&file, range).unwrap();
            assert_eq!(mapped, expected);
            // Slices outlive the bytes they were cut from (the mapping goes with the last).
            let slice = mapped.slice(10..20);
            drop(mapped);
            assert_eq!(slice, expected[10..20]);
        }
        drop(file);
        let opened = local.get(&path).await.unwrap();
        std::fs::write(dir.path().join("big.json"), &data[..len / 2]).unwrap();
        let error = read_immutable_body(opened).await.unwrap_err().to_string();
        assert!(error.contains("the file shrank"), "{error}");
    }

    #[test]
    fn only_network_and_overload_errors_are_transient() {
        let not_found = object_store::Error::NotFound {
            path: "x".into(),
            source: "gone".into(),
        };
        assert!(!is_transient(&not_found));
        let slow_down = object_store::Error::Generic {
            store: "S3",
            source: "Error performing PUT in 1s - Server returned non-2xx status code: 503 \
                     Service Unavailable: SlowDown"
                .into(),
        };
        assert!(is_transient(&slow_down));
        let forbidden = object_store::Error::Generic {
            store: "S3",
            source: "Server returned non-2xx status code: 403 Forbidden: denied".into(),
        };
        assert!(!is_transient(&forbidden));
    }
}
