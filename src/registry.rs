//! What a `sluice` binary knows beyond the built-in sources and sinks: the user's functions and
//! their own kinds of source and sink.
//!
//! A Rust program that wants the whole `sluice` command line over its own code builds a
//! [`Registry`] and hands it to [`crate::cli::run`]; job files run by that binary may then call
//! the functions in their SQL and name the kinds (`kind = "my_source"`). The stock `sluice`
//! binary runs with an empty registry.
//!
//! ```no_run
//! use sluice::Registry;
//! use sluice::engine::datafusion::logical_expr::{ScalarUDF, AggregateUDF};
//! # fn my_udf() -> ScalarUDF { unimplemented!() }
//! # fn my_udaf() -> AggregateUDF { unimplemented!() }
//! # fn my_source(_: &sluice::registry::Section) -> Result<Box<dyn sluice::engine::Source>, sluice::engine::BoxError> { unimplemented!() }
//!
//! fn main() -> std::process::ExitCode {
//!     let registry = Registry::new()
//!         .with_udf(my_udf())
//!         .with_udaf(my_udaf())
//!         .with_source("my_source", my_source);
//!     sluice::cli::run(registry)
//! }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use sluice_engine::datafusion::logical_expr::{AggregateUDF, ScalarUDF, WindowUDF};
use sluice_engine::datafusion::prelude::SessionContext;
use sluice_engine::{BoxError, Functions, Sink, Source};

use crate::error::{Error, Result};

/// A `[sources.NAME]` or `[sink]` table of a job file, for a registered kind to build from: the
/// keys every source or sink has (`kind`, `event_time`, `lineage`, `mode`, …) are already taken
/// out and handled by Sluice.
#[derive(Debug, Clone)]
pub struct Section {
    /// The section's name as the job file writes it: `sources.clicks`, `sink`.
    pub name: String,
    /// The section's own keys.
    pub table: toml::Table,
    /// The job file (relative paths in the section are relative to its folder).
    pub job_file: PathBuf,
    /// `[job] store_unavailable_timeout`: how long a store the source or sink uses may stay
    /// unreachable before the job stops (see [`sluice_engine::storage::StorageOptions`]).
    pub store_unavailable_timeout: std::time::Duration,
}

impl Section {
    /// The section's keys as `T` (a `#[derive(Deserialize)]` config; use
    /// `#[serde(deny_unknown_fields)]` so a misspelt key is an error naming it).
    ///
    /// # Errors
    /// [`Error::JobFile`] naming the file, the section and the key, if a key is unknown,
    /// missing or of the wrong type.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        crate::job_file::from_table(self.table.clone())
            .map_err(|message| Error::job_file(&self.job_file, Some(&self.name), message))
    }

    /// `path` resolved against the job file's folder (URLs and absolute paths unchanged).
    pub fn resolve(&self, path: &str) -> String {
        resolve(&self.job_dir(), path)
    }

    /// The job file's folder.
    pub fn job_dir(&self) -> PathBuf {
        job_dir(&self.job_file)
    }
}

/// The folder of the job file at `path` (`.` for a bare file name).
pub(crate) fn job_dir(path: &Path) -> PathBuf {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Resolves a path of a job file against the job file's folder (URLs and absolute paths stay).
pub(crate) fn resolve(base: &Path, path: &str) -> String {
    if path.contains("://") || Path::new(path).is_absolute() {
        path.to_string()
    } else {
        base.join(path).to_string_lossy().into_owned()
    }
}

/// Builds a source from its job-file section. Any error type will do (`?` boxes it); the job
/// file's error keeps it as its source, naming the file and section.
pub type SourceFactory = Arc<dyn Fn(&Section) -> Result<Box<dyn Source>, BoxError> + Send + Sync>;
/// Builds a sink from its job-file section, failing as a [`SourceFactory`] does.
pub type SinkFactory = Arc<dyn Fn(&Section) -> Result<Box<dyn Sink>, BoxError> + Send + Sync>;

/// The functions and the kinds of source and sink a binary adds to the built-in ones.
#[derive(Clone, Default)]
pub struct Registry {
    functions: Functions,
    sources: BTreeMap<String, SourceFactory>,
    sinks: BTreeMap<String, SinkFactory>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("functions", &self.functions.names())
            .field("sources", &self.sources.keys().collect::<Vec<_>>())
            .field("sinks", &self.sinks.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The source kinds every build has.
pub const BUILT_IN_SOURCES: [&str; 3] = ["files", "kafka", "nexmark"];
/// The sink kinds every build has.
pub const BUILT_IN_SINKS: [&str; 1] = ["delta"];

impl Registry {
    /// An empty registry: the built-in sources and sinks and DataFusion's functions.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds a scalar function every job's SQL may call.
    ///
    /// # Panics
    /// If DataFusion has a function of that name (a job file must mean the same in every
    /// binary), or one was registered under it already.
    pub fn with_udf(mut self, function: ScalarUDF) -> Self {
        self.refuse_taken(function.name());
        self.functions.scalar.push(function);
        self
    }

    /// Adds an aggregate function every job's SQL may call; its state is carried between batches
    /// like a built-in aggregate's (see [`sluice_engine::Functions`]).
    ///
    /// # Panics
    /// As [`Registry::with_udf`].
    pub fn with_udaf(mut self, function: AggregateUDF) -> Self {
        self.refuse_taken(function.name());
        self.functions.aggregate.push(function);
        self
    }

    /// Adds a window function (`… OVER (…)`) every job's SQL may call.
    ///
    /// # Panics
    /// As [`Registry::with_udf`].
    pub fn with_udwf(mut self, function: WindowUDF) -> Self {
        self.refuse_taken(function.name());
        self.functions.window.push(function);
        self
    }

    /// Panics if `name` is a DataFusion function or already registered: a registered function
    /// must not change what a job file's SQL means elsewhere.
    fn refuse_taken(&self, name: &str) {
        let state = SessionContext::new().state();
        let built_in = state.scalar_functions().contains_key(name)
            || state.aggregate_functions().contains_key(name)
            || state.window_functions().contains_key(name);
        assert!(
            !built_in,
            "function '{name}' is one of DataFusion's; register yours under another name"
        );
        assert!(
            !self.functions.names().iter().any(|n| n == name),
            "function '{name}' is registered twice"
        );
    }

    /// Adds a kind of source: a job file's `[sources.NAME] kind = "<kind>"` is built by
    /// `factory` from the section's other keys.
    ///
    /// # Panics
    /// If `kind` is a built-in source kind (files, kafka, nexmark): a job file must mean the same
    /// thing in every Sluice binary.
    pub fn with_source<F>(mut self, kind: &str, factory: F) -> Self
    where
        F: Fn(&Section) -> Result<Box<dyn Source>, BoxError> + Send + Sync + 'static,
    {
        assert!(
            !BUILT_IN_SOURCES.contains(&kind),
            "source kind '{kind}' is built in; register your source under another name"
        );
        self.sources.insert(kind.to_string(), Arc::new(factory));
        self
    }

    /// Adds a kind of sink: a job file's `[sink] kind = "<kind>"` is built by `factory` from
    /// the section's other keys.
    ///
    /// # Panics
    /// If `kind` is a built-in sink kind (delta).
    pub fn with_sink<F>(mut self, kind: &str, factory: F) -> Self
    where
        F: Fn(&Section) -> Result<Box<dyn Sink>, BoxError> + Send + Sync + 'static,
    {
        assert!(
            !BUILT_IN_SINKS.contains(&kind),
            "sink kind '{kind}' is built in; register your sink under another name"
        );
        self.sinks.insert(kind.to_string(), Arc::new(factory));
        self
    }

    /// The registered functions.
    pub fn functions(&self) -> &Functions {
        &self.functions
    }

    /// The factory of a registered source kind.
    pub fn source(&self, kind: &str) -> Option<&SourceFactory> {
        self.sources.get(kind)
    }

    /// The factory of a registered sink kind.
    pub fn sink(&self, kind: &str) -> Option<&SinkFactory> {
        self.sinks.get(kind)
    }

    /// Every source kind this build has, built-in first, for messages.
    pub fn source_kinds(&self) -> Vec<String> {
        let built_in = BUILT_IN_SOURCES.iter().map(|k| k.to_string());
        built_in.chain(self.sources.keys().cloned()).collect()
    }

    /// Every sink kind this build has, built-in first, for messages.
    pub fn sink_kinds(&self) -> Vec<String> {
        let built_in = BUILT_IN_SINKS.iter().map(|k| k.to_string());
        built_in.chain(self.sinks.keys().cloned()).collect()
    }
}
