//! `sluice::Error`: what the library's API fails with, typed so a caller can match it.
//!
//! The façade's own failures are about job files ([`Error::ReadJobFile`], [`Error::JobFile`],
//! naming the file and the section); everything else is the error of the crate that failed,
//! kept whole: the engine's ([`sluice_engine::Error`]: a lease held by another run, an
//! expectation that failed, too many dead letters, …), a built-in source's
//! ([`sluice_connectors::ConnectorError`]) or sink's ([`sluice_sinks::SinkError`]). A source's or
//! sink's error raised while a job runs travels inside the engine's error; [`Error::find`] finds
//! an error of a given type wherever it is in the chain:
//!
//! ```
//! use sluice::connectors::ConnectorError;
//! use sluice::engine::Error as EngineError;
//!
//! // What a run of a Kafka job returns when retention deleted offsets it still needed.
//! let lost = ConnectorError::DataLoss { partition: "clicks partition 0".into(), wanted: 7, earliest: 9 };
//! let error = sluice::Error::from(EngineError::in_source("clicks", lost));
//! match error.find::<ConnectorError>() {
//!     Some(ConnectorError::DataLoss { wanted, earliest, .. }) => assert_eq!((*wanted, *earliest), (7, 9)),
//!     other => panic!("{other:?}"),
//! }
//! ```
//!
//! Every message includes its cause's, so `error.to_string()` is the whole story on one line.

use std::path::PathBuf;

use sluice_connectors::ConnectorError;
use sluice_engine::BoxError;
use sluice_sinks::SinkError;

/// What the `sluice` library fails with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The job file could not be read.
    #[error(
        "cannot read job file {}: {source}",
        on_one_line(&path.display().to_string())
    )]
    ReadJobFile {
        /// The job file.
        path: PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
    /// The job file is not a job this build can run: a key is unknown, missing or invalid, a
    /// kind is not built in, or a source or sink refused its settings.
    #[error(
        "job file {}: {}{}",
        on_one_line(&path.display().to_string()),
        on_one_line(&in_section(section)),
        on_one_line(message)
    )]
    JobFile {
        /// The job file.
        path: PathBuf,
        /// The section at fault as the file writes it (`sources.clicks`, `sink`,
        /// `[expectations]`); `None` for the file as a whole.
        section: Option<String>,
        /// What is wrong, naming the key; includes the cause's message.
        message: String,
        /// Why, when another error says it (the engine's, a connector's, a registered
        /// factory's).
        #[source]
        source: Option<BoxError>,
    },
    /// A built-in source refused its configuration or failed outside a job run.
    #[error("{0}")]
    Connector(#[source] ConnectorError),
    /// A built-in sink refused its configuration or failed outside a job run (e.g. reading a
    /// table).
    #[error("{0}")]
    Sink(#[source] Box<SinkError>),
    /// The engine failed: planning, running, backfilling or reconciling a job (a source's or
    /// sink's error during a run is inside it; see [`Error::find`]).
    #[error("{0}")]
    Engine(#[from] sluice_engine::Error),
}

impl From<SinkError> for Error {
    fn from(e: SinkError) -> Self {
        match e {
            // The engine's error (a location refused) is the engine's, wherever it surfaced.
            SinkError::Engine(inner) => Error::Engine(inner),
            // Boxed: delta-rs's errors are large, and every `Result` of the API carries the size.
            other => Error::Sink(Box::new(other)),
        }
    }
}

impl From<ConnectorError> for Error {
    fn from(e: ConnectorError) -> Self {
        match e {
            ConnectorError::Engine(inner) => Error::Engine(inner),
            other => Error::Connector(other),
        }
    }
}

/// The `sluice` library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `[section]: ` before a job file error's message, or nothing.
fn in_section(section: &Option<String>) -> String {
    match section {
        Some(s) => format!("[{s}]: "),
        None => String::new(),
    }
}

/// `text` with its control characters escaped (a newline as `\n`), so a job file error that
/// quotes what the file holds (a string, a quoted section name, a path may hold any character)
/// stays one line.
pub(crate) fn on_one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    std::borrow::Cow::Owned(escaped)
}

impl Error {
    /// The first error of type `E` in this error's chain (itself, its source, its source's
    /// source, …): e.g. `find::<sluice::engine::Error>()`, `find::<ConnectorError>()`,
    /// `find::<SinkError>()`, or a registered source's own error type.
    pub fn find<E: std::error::Error + 'static>(&self) -> Option<&E> {
        sluice_engine::error::find_in_chain(self)
    }

    /// A refusal of the job file at `path`, in `section` (`None`: the file as a whole).
    pub(crate) fn job_file(
        path: &std::path::Path,
        section: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        Error::JobFile {
            path: path.to_path_buf(),
            section: section.map(str::to_string),
            message: message.into(),
            source: None,
        }
    }

    /// `cause` as a failure of the job file at `path`, in `section`, kept as the source. A
    /// cause that is a job file error already (a registered factory's
    /// [`crate::registry::Section::parse`]) is returned as it is.
    pub(crate) fn job_file_cause(
        path: &std::path::Path,
        section: Option<&str>,
        cause: impl Into<BoxError>,
    ) -> Self {
        let cause = cause.into();
        let cause = match cause.downcast::<Error>() {
            Ok(error) if matches!(*error, Error::JobFile { .. } | Error::ReadJobFile { .. }) => {
                return *error;
            }
            Ok(error) => error as BoxError,
            Err(cause) => cause,
        };
        Error::JobFile {
            path: path.to_path_buf(),
            section: section.map(str::to_string),
            message: cause.to_string(),
            source: Some(cause),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job file's path holding a newline is shown escaped, on one line.
    #[test]
    fn a_path_with_a_newline_is_shown_on_one_line() {
        let path = std::path::PathBuf::from("jobs/a\nb.toml");
        let unread = Error::ReadJobFile {
            path: path.clone(),
            source: std::io::Error::other("not found"),
        };
        assert_eq!(
            unread.to_string(),
            "cannot read job file jobs/a\\nb.toml: not found"
        );
        let refused = Error::job_file(&path, Some("sink"), "no path");
        assert_eq!(
            refused.to_string(),
            "job file jobs/a\\nb.toml: [sink]: no path"
        );
    }

    /// A sink's, a connector's and the engine's error are found wherever they sit in the chain,
    /// and the top message includes theirs.
    #[test]
    fn find_reaches_every_layer() {
        let sink = || SinkError::Config("path is empty".into());
        let direct = Error::from(sink());
        assert!(matches!(
            direct.find::<SinkError>(),
            Some(SinkError::Config(_))
        ));
        let in_run = Error::from(sluice_engine::Error::from(sink()));
        assert!(matches!(
            in_run.find::<SinkError>(),
            Some(SinkError::Config(_))
        ));
        assert!(matches!(
            in_run.find::<sluice_engine::Error>(),
            Some(sluice_engine::Error::Sink(_))
        ));
        assert!(in_run.to_string().contains("path is empty"), "{in_run}");

        let lost = ConnectorError::Config("topic is empty".into());
        let in_run = Error::from(sluice_engine::Error::in_source("clicks", lost));
        assert!(matches!(
            in_run.find::<ConnectorError>(),
            Some(ConnectorError::Config(_))
        ));
        assert!(in_run.find::<SinkError>().is_none());
        let text = in_run.to_string();
        assert!(
            text.contains("source 'clicks'") && text.contains("topic is empty"),
            "{text}"
        );
    }

    /// A job file error keeps its cause; a cause that is a job file error already is not
    /// wrapped twice.
    #[test]
    fn a_job_file_error_keeps_its_cause_once() {
        let path = std::path::Path::new("jobs/a.toml");
        let cause = sluice_engine::Error::InvalidJob("trigger is wrong".into());
        let error = Error::job_file_cause(path, Some("trigger"), cause);
        assert_eq!(
            error.to_string(),
            "job file jobs/a.toml: [trigger]: invalid job: trigger is wrong"
        );
        assert!(error.find::<sluice_engine::Error>().is_some());
        let inner = Error::job_file(path, Some("sources.pages"), "`pages = 0`: must be > 0");
        let again = Error::job_file_cause(path, Some("sources.pages"), inner);
        assert_eq!(
            again.to_string(),
            "job file jobs/a.toml: [sources.pages]: `pages = 0`: must be > 0"
        );
    }
}
