//! The job file: TOML that names the sources, the static tables the query joins, the query,
//! the sink and the trigger.
//!
//! This is the one place that maps `kind = "…"` to a concrete connector or sink (built in,
//! or registered by the binary: [`Registry`]), so the engine stays free of them. Keys shared
//! by every source (`kind`, `event_time`, `event_time_format`, `max_out_of_orderness`,
//! `idle_timeout`) are read here; the rest of a `[sources.<name>]` table goes to the
//! connector's own config, which rejects unknown keys by name. Relative paths are resolved
//! against the job file's folder, so a job file works from any working directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sluice_connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice_connectors::files_table::FilesTable;
#[cfg(feature = "kafka")]
use sluice_connectors::kafka::{KafkaSource, KafkaSourceConfig};
use sluice_connectors::nexmark::{NexmarkSource, NexmarkSourceConfig};
use sluice_engine::storage::StorageOptions;
use sluice_engine::{
    BoxError, EventTimeConfig, EventTimeFormat, Expectation, Job, OutputMode, Trigger,
    parse_duration,
};
use sluice_sinks::delta::{DeltaSink, DeltaSinkConfig};
use sluice_sinks::delta_table::DeltaTableSource;

use crate::error::{Error, Result};
use crate::registry::{Registry, Section, resolve};

/// The whole job file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    job: JobSection,
    sources: BTreeMap<String, toml::Table>,
    #[serde(default)]
    tables: BTreeMap<String, toml::Table>,
    sink: toml::Table,
    #[serde(default)]
    trigger: TriggerSection,
    query: QuerySection,
    #[serde(default)]
    expectations: Vec<ExpectationSection>,
}

/// One `[[expectations]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectationSection {
    name: String,
    check: String,
    on_failure: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobSection {
    id: String,
    #[serde(default)]
    checkpoint: Option<String>,
    /// Where `sluice run` serves metrics and the status page (`127.0.0.1:9898`).
    #[serde(default)]
    metrics_addr: Option<String>,
    /// How long an object store may stay unreachable before the job stops (default 10 min).
    #[serde(default)]
    store_unavailable_timeout: Option<String>,
    /// How many batch folders (intent, manifest) the checkpoint keeps (default 10).
    #[serde(default)]
    keep_batches: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TriggerSection {
    #[serde(default = "default_trigger_mode")]
    mode: String,
    #[serde(default)]
    interval: Option<String>,
}

impl Default for TriggerSection {
    fn default() -> Self {
        TriggerSection {
            mode: default_trigger_mode(),
            interval: None,
        }
    }
}

fn default_trigger_mode() -> String {
    "available-now".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuerySection {
    sql: String,
    #[serde(default)]
    allowed_lateness: Option<String>,
    #[serde(default)]
    state_ttl: Option<String>,
}

/// The keys every source has, whatever its kind.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceCommon {
    kind: String,
    #[serde(default)]
    event_time: Option<String>,
    #[serde(default)]
    event_time_format: Option<String>,
    #[serde(default)]
    max_out_of_orderness: Option<String>,
    #[serde(default)]
    idle_timeout: Option<String>,
    #[serde(default)]
    max_event_time_skew: Option<String>,
}
const SOURCE_COMMON_KEYS: [&str; 6] = [
    "kind",
    "event_time",
    "event_time_format",
    "max_out_of_orderness",
    "idle_timeout",
    "max_event_time_skew",
];

/// A `[tables.<name>]` table: a Delta table (`kind = "delta"`) or a folder of files (`kind =
/// "files"`) the query joins whole, read at the version each batch's intent records.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TableSection {
    path: String,
    #[serde(default)]
    storage_options: StorageOptions,
    /// Files: `json`, `csv` or `parquet`.
    #[serde(default)]
    format: Option<FileFormat>,
    /// Files: the columns, as SQL column definitions (required for JSON and CSV).
    #[serde(default)]
    schema: Option<String>,
    /// Files, CSV: whether each file starts with a header line (default true).
    #[serde(default)]
    header: Option<bool>,
    /// Files, CSV: the field delimiter, one character (default `,`).
    #[serde(default)]
    delimiter: Option<String>,
}

/// The keys every sink has, whatever its kind.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SinkCommon {
    kind: String,
    #[serde(default = "default_true")]
    lineage: bool,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    key: Option<Vec<String>>,
    #[serde(default)]
    max_dead_letter_fraction: Option<f64>,
}
const SINK_COMMON_KEYS: [&str; 5] = ["kind", "lineage", "mode", "key", "max_dead_letter_fraction"];

fn default_true() -> bool {
    true
}

/// What `load` found besides the job, for messages.
#[derive(Debug, Clone)]
pub struct JobFileInfo {
    /// The job file.
    pub path: PathBuf,
    /// The job id.
    pub job_id: String,
    /// `[job] metrics_addr`: where `sluice run` serves metrics and the status page.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `[sink.storage_options]`: how the output table's store is configured.
    pub sink_storage: StorageOptions,
    /// `[sink] kind`: `delta`, or a kind the binary registered.
    pub sink_kind: String,
}

/// Splits `table` into the keys in `common` and the rest.
fn split(table: &toml::Table, common: &[&str]) -> (toml::Table, toml::Table) {
    let (mut shared, mut rest) = (toml::Table::new(), toml::Table::new());
    for (k, v) in table {
        if common.contains(&k.as_str()) {
            shared.insert(k.clone(), v.clone());
        } else {
            rest.insert(k.clone(), v.clone());
        }
    }
    (shared, rest)
}

/// Adds `[job] store_unavailable_timeout` to the `storage_options` table of a source or sink
/// (creating it), where [`StorageOptions`] reads it back.
fn add_unavailable_timeout(table: &mut toml::Table, timeout: Duration) {
    let options = table
        .entry("storage_options")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(options) = options {
        options.insert(
            StorageOptions::UNAVAILABLE_TIMEOUT_KEY.into(),
            toml::Value::String(timeout.as_millis().to_string()),
        );
    }
}

/// Reads and checks a job file and builds the job. `trigger` overrides the file's `[trigger]`;
/// `registry` adds functions and kinds of source and sink to the built-in ones.
///
/// # Errors
/// Errors name the file and the section or key at fault.
pub async fn load(
    path: &Path,
    trigger: Option<Trigger>,
    registry: &Registry,
) -> Result<(Job, JobFileInfo)> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::ReadJobFile {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, path, trigger, registry)
}

/// Builds the job from the text of a job file at `path` (relative paths in it are relative to
/// its folder). Every error is one line naming the file and the section or key at fault.
///
/// # Errors
/// As [`load`].
pub fn parse(
    text: &str,
    path: &Path,
    trigger: Option<Trigger>,
    registry: &Registry,
) -> Result<(Job, JobFileInfo)> {
    let file: JobFile =
        toml::from_str(text).map_err(|e| Error::job_file(path, None, one_line(&e, text)))?;
    let base = crate::registry::job_dir(path);
    // A refusal naming the section, and a cause in a section kept as the error's source.
    let invalid = |section: &str, message: String| Error::job_file(path, Some(section), message);
    let failed = |section: &str, cause: BoxError| Error::job_file_cause(path, Some(section), cause);

    let trigger = match trigger {
        Some(t) => t,
        None => parse_trigger(&file.trigger).map_err(|e| failed("trigger", e))?,
    };
    let state_ttl = match &file.query.state_ttl {
        Some(v) => Some(parse_duration("state_ttl", v).map_err(|e| failed("query", e.into()))?),
        None => None,
    };
    let allowed_lateness = match &file.query.allowed_lateness {
        Some(v) => parse_duration("allowed_lateness", v).map_err(|e| failed("query", e.into()))?,
        None => Duration::ZERO,
    };

    let store_unavailable_timeout = match &file.job.store_unavailable_timeout {
        Some(v) => {
            parse_duration("store_unavailable_timeout", v).map_err(|e| failed("job", e.into()))?
        }
        None => sluice_engine::storage::DEFAULT_UNAVAILABLE_TIMEOUT,
    };

    let mut builder = Job::builder(file.job.id.clone())
        .with_sql(file.query.sql.clone())
        .with_trigger(trigger)
        .with_allowed_lateness(allowed_lateness)
        .with_functions(registry.functions());
    if let Some(ttl) = state_ttl {
        builder = builder.with_state_ttl(ttl);
    }
    if let Some(keep) = file.job.keep_batches {
        builder = builder.with_keep_batches(keep);
    }
    if let Some(checkpoint) = &file.job.checkpoint {
        let url = sluice_engine::location::directory_url(&resolve(&base, checkpoint))
            .map_err(|e| failed("job", e.into()))?;
        builder = builder.with_checkpoint(url);
    }

    if file.sources.is_empty() {
        return Err(invalid("sources", "no [sources.<name>] table".into()));
    }
    for (name, table) in &file.sources {
        let section = format!("sources.{name}");
        let (shared, mut rest) = split(table, &SOURCE_COMMON_KEYS);
        let common: SourceCommon = from_table(shared).map_err(|e| invalid(&section, e))?;
        let event_time = event_time_config(&common).map_err(|e| failed(&section, e))?;
        let source = match common.kind.as_str() {
            "files" => {
                if let Some(toml::Value::String(p)) = rest.get("path") {
                    let resolved = resolve(&base, p);
                    rest.insert("path".into(), toml::Value::String(resolved));
                }
                add_unavailable_timeout(&mut rest, store_unavailable_timeout);
                let config: FilesSourceConfig =
                    from_table(rest).map_err(|e| invalid(&section, e))?;
                Box::new(FilesSource::new(config).map_err(|e| failed(&section, e.into()))?)
                    as Box<dyn sluice_engine::Source>
            }
            #[cfg(not(feature = "kafka"))]
            "kafka" => {
                return Err(invalid(
                    &section,
                    "this build has no Kafka source (the sluice crate was built without its \
                     `kafka` feature)"
                        .into(),
                ));
            }
            #[cfg(feature = "kafka")]
            "kafka" => {
                let config: KafkaSourceConfig =
                    from_table(rest).map_err(|e| invalid(&section, e))?;
                Box::new(KafkaSource::new(config).map_err(|e| failed(&section, e.into()))?)
            }
            "nexmark" => {
                let config: NexmarkSourceConfig =
                    from_table(rest).map_err(|e| invalid(&section, e))?;
                Box::new(NexmarkSource::new(config).map_err(|e| failed(&section, e.into()))?)
            }
            other => match registry.source(other) {
                Some(factory) => {
                    let custom = Section {
                        name: section.clone(),
                        table: rest,
                        job_file: path.to_path_buf(),
                        store_unavailable_timeout,
                    };
                    factory(&custom).map_err(|e| failed(&section, e))?
                }
                None => {
                    return Err(invalid(
                        &section,
                        format!(
                            "kind = \"{other}\" is not a source this build has ({})",
                            registry.source_kinds().join(", ")
                        ),
                    ));
                }
            },
        };
        builder = builder.with_source(name.clone(), source, event_time);
    }

    for (name, table) in &file.tables {
        let section = format!("tables.{name}");
        let kind = match table.get("kind").and_then(toml::Value::as_str) {
            Some(kind @ ("delta" | "files")) => kind.to_string(),
            Some(other) => {
                return Err(invalid(
                    &section,
                    format!(
                        "kind = \"{other}\" is not a static table this build has (delta, files)"
                    ),
                ));
            }
            None => {
                return Err(invalid(
                    &section,
                    "needs kind = \"delta\" or \"files\"".into(),
                ));
            }
        };
        let mut table = table.clone();
        table.remove("kind");
        add_unavailable_timeout(&mut table, store_unavailable_timeout);
        let config: TableSection = from_table(table).map_err(|e| invalid(&section, e))?;
        let url = sluice_engine::location::directory_url(&resolve(&base, &config.path))
            .map_err(|e| failed(&section, e.into()))?;
        let files_only = [
            ("format", config.format.is_some()),
            ("schema", config.schema.is_some()),
            ("header", config.header.is_some()),
            ("delimiter", config.delimiter.is_some()),
        ];
        let table: Box<dyn sluice_engine::StaticTable> = if kind == "delta" {
            if let Some((key, _)) = files_only.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    &section,
                    format!("{key} is a setting of kind = \"files\"; a Delta table has its own"),
                ));
            }
            Box::new(DeltaTableSource::new(url, config.storage_options))
        } else {
            let format = config.format.ok_or_else(|| {
                invalid(
                    &section,
                    "needs format = \"json\", \"csv\" or \"parquet\"".into(),
                )
            })?;
            if config.schema.is_none() && format != FileFormat::Parquet {
                return Err(invalid(
                    &section,
                    "a JSON or CSV table needs its columns: schema = \"id BIGINT, …\"".into(),
                ));
            }
            if format != FileFormat::Csv
                && let Some((key, _)) = files_only[2..].iter().find(|(_, set)| *set)
            {
                return Err(invalid(
                    &section,
                    format!("{key} is a setting of format = \"csv\""),
                ));
            }
            let delimiter = match config.delimiter.as_deref().map(str::as_bytes) {
                None => b',',
                Some([one]) if !matches!(one, b'"' | b'\r' | b'\n') => *one,
                Some(_) => {
                    return Err(invalid(
                        &section,
                        "delimiter must be exactly one (ASCII) character, not a quote or a line \
                         break"
                            .into(),
                    ));
                }
            };
            Box::new(
                FilesTable::new(url, format, config.schema, config.storage_options)
                    .with_csv(config.header.unwrap_or(true), delimiter),
            )
        };
        builder = builder.with_table(name.clone(), table);
    }

    let (shared, mut rest) = split(&file.sink, &SINK_COMMON_KEYS);
    let common: SinkCommon = from_table(shared).map_err(|e| invalid("sink", e))?;
    let sink_storage: StorageOptions;
    let sink = match common.kind.as_str() {
        "delta" => {
            for key in ["path", "dead_letter_path", "late_path"] {
                if let Some(toml::Value::String(p)) = rest.get(key) {
                    let resolved = resolve(&base, p);
                    rest.insert(key.into(), toml::Value::String(resolved));
                }
            }
            add_unavailable_timeout(&mut rest, store_unavailable_timeout);
            let config: DeltaSinkConfig = from_table(rest).map_err(|e| invalid("sink", e))?;
            sink_storage = config.storage_options.clone();
            Box::new(DeltaSink::new(config).map_err(|e| failed("sink", e.into()))?)
        }
        other => match registry.sink(other) {
            Some(factory) => {
                let custom = Section {
                    name: "sink".into(),
                    table: rest,
                    job_file: path.to_path_buf(),
                    store_unavailable_timeout,
                };
                let sink = factory(&custom).map_err(|e| failed("sink", e))?;
                sink_storage = sink.storage_options();
                sink
            }
            None => {
                return Err(invalid(
                    "sink",
                    format!(
                        "kind = \"{other}\" is not a sink this build has ({})",
                        registry.sink_kinds().join(", ")
                    ),
                ));
            }
        },
    };
    let mode: OutputMode = match &common.mode {
        Some(m) => m
            .parse()
            .map_err(|e: sluice_engine::Error| failed("sink", e.into()))?,
        None => OutputMode::Append,
    };
    if common.key.is_some() && mode != OutputMode::Update {
        return Err(invalid(
            "sink",
            "key is the upsert key of mode = \"update\"; remove it or set the mode".into(),
        ));
    }
    if let Some(fraction) = common.max_dead_letter_fraction {
        builder = builder.with_max_dead_letter_fraction(fraction);
    }
    for (i, e) in file.expectations.into_iter().enumerate() {
        let on_failure = e
            .on_failure
            .parse()
            .map_err(|cause: sluice_engine::Error| {
                let message = format!("#{} ({}): {cause}", i + 1, e.name);
                Error::JobFile {
                    path: path.to_path_buf(),
                    section: Some("[expectations]".into()),
                    message,
                    source: Some(cause.into()),
                }
            })?;
        builder = builder.with_expectation(Expectation {
            name: e.name,
            check: e.check,
            on_failure,
        });
    }
    let job = builder
        .with_sink(sink)
        .with_output_mode(mode, common.key)
        .with_lineage(common.lineage)
        .build()
        .map_err(|e| Error::job_file_cause(path, None, e))?;
    let metrics_addr = match &file.job.metrics_addr {
        None => None,
        Some(text) => Some(text.parse().map_err(|e| {
            invalid(
                "job",
                format!("metrics_addr = \"{text}\" is not an address like 127.0.0.1:9898: {e}"),
            )
        })?),
    };
    let info = JobFileInfo {
        path: path.to_path_buf(),
        job_id: file.job.id,
        metrics_addr,
        sink_storage,
        sink_kind: common.kind,
    };
    Ok((job, info))
}

/// A TOML error as one line: where it is in `text` (`line N`, and the line itself, which names
/// the key), then what is wrong.
fn one_line(e: &toml::de::Error, text: &str) -> String {
    match locate(e, text) {
        Some((number, line)) => format!("line {number} (`{line}`): {}", message(e)),
        None => message(e),
    }
}

/// The error's message on one line.
fn message(e: &toml::de::Error) -> String {
    e.message().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The number and text (first 80 characters) of the line of `text` an error points at.
fn locate(e: &toml::de::Error, text: &str) -> Option<(usize, String)> {
    let start = e.span()?.start;
    let before = text.get(..start)?;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("").trim();
    Some((
        before.matches('\n').count() + 1,
        line.chars().take(80).collect(),
    ))
}

/// A table of the job file (a section minus the keys read elsewhere) as `T`. The table is
/// written back as TOML and read with positions, so a bad value's error shows its key (line
/// numbers in the rewritten table would mean nothing to the user, so they are left out).
pub(crate) fn from_table<T: serde::de::DeserializeOwned>(table: toml::Table) -> Result<T, String> {
    let text = toml::to_string(&table).map_err(|e| e.to_string())?;
    toml::from_str(&text).map_err(|e| match locate(&e, &text) {
        Some((_, line)) => format!("`{line}`: {}", message(&e)),
        None => message(&e),
    })
}

fn parse_trigger(section: &TriggerSection) -> Result<Trigger, BoxError> {
    match (section.mode.as_str(), &section.interval) {
        ("interval", Some(every)) => Ok(Trigger::Interval(parse_duration("interval", every)?)),
        ("interval", None) => Err("mode = \"interval\" needs interval = \"<duration>\"".into()),
        (mode, Some(_)) => {
            Err(format!("interval is only used with mode = \"interval\", not \"{mode}\"").into())
        }
        (mode, None) => Ok(mode.parse()?),
    }
}

fn event_time_config(common: &SourceCommon) -> Result<Option<EventTimeConfig>, BoxError> {
    let Some(column) = &common.event_time else {
        for (key, v) in [
            ("event_time_format", &common.event_time_format),
            ("max_out_of_orderness", &common.max_out_of_orderness),
            ("idle_timeout", &common.idle_timeout),
            ("max_event_time_skew", &common.max_event_time_skew),
        ] {
            if v.is_some() {
                return Err(format!("{key} is set but event_time is not").into());
            }
        }
        return Ok(None);
    };
    let format: EventTimeFormat = match &common.event_time_format {
        Some(f) => f.parse()?,
        None => EventTimeFormat::Rfc3339,
    };
    let max_out_of_orderness = match &common.max_out_of_orderness {
        Some(d) => parse_duration("max_out_of_orderness", d)?,
        None => Duration::ZERO,
    };
    let idle_timeout = common
        .idle_timeout
        .as_deref()
        .map(|d| parse_duration("idle_timeout", d))
        .transpose()?;
    let max_event_time_skew = match &common.max_event_time_skew {
        Some(d) => parse_duration("max_event_time_skew", d)?,
        None => sluice_engine::event_time::DEFAULT_MAX_EVENT_TIME_SKEW,
    };
    Ok(Some(EventTimeConfig {
        column: column.clone(),
        format,
        max_out_of_orderness,
        idle_timeout,
        max_event_time_skew,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The job files of `fuzz/corpus/job_files`.
    fn corpus() -> Vec<(PathBuf, String)> {
        let dir = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("fuzz/corpus/job_files");
        let mut files: Vec<(PathBuf, String)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                let text = std::fs::read_to_string(&path).unwrap();
                (path, text)
            })
            .collect();
        files.sort();
        files
    }

    /// Loading never panics, and a refusal is one line naming the file.
    fn exercise(text: &str, path: &Path) {
        if let Err(e) = parse(text, path, None, &Registry::new()) {
            let message = format!("{e:#}");
            assert!(!message.contains('\n'), "not one line: {message}");
            assert!(message.contains("job file"), "{message}");
        }
    }

    #[test]
    fn fuzz_corpus_job_files_load_without_panics() {
        for (path, text) in corpus() {
            exercise(&text, &path);
        }
    }

    /// A value holding a newline (a TOML escape) is quoted on one line: the case the mutation
    /// fuzzing below once found (`available-now` cut to `availabl\now`).
    #[test]
    fn a_value_with_a_newline_is_refused_on_one_line() {
        let (path, text) = corpus()
            .into_iter()
            .find(|(_, text)| text.contains("\"available-now\""))
            .unwrap();
        let original = text;
        let text = original.replace("\"available-now\"", "\"availabl\\now\"");
        let message = parse(&text, &path, None, &Registry::new())
            .err()
            .unwrap()
            .to_string();
        assert!(message.contains("availabl\\now"), "{message}");
        exercise(&text, &path);

        // A quoted section name, and an error built outside the two constructors, added to a
        // file that loads.
        let (path, original) = corpus()
            .into_iter()
            .find(|(path, text)| parse(text, path, None, &Registry::new()).is_ok())
            .unwrap();
        let section = format!("{original}\n[sources.\"a\\nb\"]\nkind = \"bogus\"\n");
        let expectation = format!(
            "{original}\n[[expectations]]\nname = \"x\\ty\"\ncheck = \"true\"\non_failure = \"stop\\nnow\"\n"
        );
        for (text, quoted) in [(section, "a\\nb"), (expectation, "stop\\nnow")] {
            let message = parse(&text, &path, None, &Registry::new())
                .err()
                .unwrap()
                .to_string();
            assert!(message.contains(quoted), "{message}");
            exercise(&text, &path);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]
        /// Corpus files with a slice replaced by arbitrary text.
        #[test]
        fn fuzz_mutated_job_files_load_without_panics(
            pick in 0usize..64,
            at in 0usize..4096,
            cut in 0usize..40,
            insert in proptest::prelude::any::<String>(),
        ) {
            let files = corpus();
            let (path, text) = &files[pick % files.len()];
            let mut bytes = text.as_bytes().to_vec();
            let start = at % (bytes.len() + 1);
            let end = (start + cut).min(bytes.len());
            bytes.splice(start..end, insert.into_bytes());
            exercise(&String::from_utf8_lossy(&bytes), path);
        }

        #[test]
        fn fuzz_arbitrary_text_loads_without_panics(text in proptest::prelude::any::<String>()) {
            exercise(&text, Path::new("job.toml"));
        }
    }
}
