//! Locations: the folder a source reads, a table lives in or a checkpoint is kept in, given in a
//! job as a local path or a URL, turned into one directory URL.
//!
//! Every crate that takes a location from the user goes through [`directory_url`], so a path
//! means the same thing for a source, a sink and a checkpoint.

use url::Url;

use crate::error::{Error, Result};

/// Turns a local path (made absolute against the working directory, `.` and `..` resolved
/// lexically) or a URL into a directory URL ending in `/`.
///
/// # Errors
/// If the text looks like a URL but does not parse, or the path cannot be made absolute; the
/// message quotes the input.
pub fn directory_url(location: &str) -> Result<Url> {
    let mut url = if location.contains("://") {
        Url::parse(location)
            .map_err(|e| Error::InvalidJob(format!("location '{location}' is not a URL: {e}")))?
    } else {
        let mut abs = std::path::PathBuf::new();
        for part in std::path::absolute(location)?.components() {
            match part {
                std::path::Component::ParentDir => {
                    abs.pop();
                }
                std::path::Component::CurDir => {}
                other => abs.push(other),
            }
        }
        Url::from_directory_path(&abs).map_err(|_| {
            Error::InvalidJob(format!(
                "location '{location}' is not a valid directory path"
            ))
        })?
    };
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_urls_become_directory_urls() {
        assert_eq!(
            directory_url("/data/in").unwrap().as_str(),
            "file:///data/in/"
        );
        assert_eq!(
            directory_url("s3://bucket/x").unwrap().as_str(),
            "s3://bucket/x/"
        );
        assert_eq!(
            directory_url("/data/jobs/../out/./t").unwrap().as_str(),
            "file:///data/out/t/"
        );
        let relative = directory_url("rel/dir").unwrap();
        assert!(relative.path().ends_with("/rel/dir/"), "{relative}");
        assert!(
            directory_url("s3://[bad")
                .unwrap_err()
                .to_string()
                .contains("s3://[bad")
        );
    }
}
