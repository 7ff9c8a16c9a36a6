//! A folder of plain files joined whole by a streaming query (`[tables.NAME] kind = "files"`):
//! an implementation of [`sluice_engine::StaticTable`] — a dimension table kept as JSON lines,
//! CSV or Parquet files rather than a Delta table.
//!
//! **Version.** Plain files have no history, so a version is a fingerprint of the folder's
//! listing: `<files>-<hash>`, the hash (FNV-1a, 64 bits) over the table's settings (format,
//! schema, CSV header and delimiter) and every file's name, size and e-tag (or modification
//! time), sorted by name. Files anywhere below the folder count, except those under a name
//! starting with `.` or `_` (hidden files, `_temporary/`, `_delta_log/`) and empty objects
//! (folder markers). The batch intent records the newest fingerprint at planning; a file added,
//! removed or rewritten — or a setting changed — gives a new one, picked up by the next batch.
//! Reading a version reads exactly the files of the listing it came from, checking each file's
//! size and e-tag as it is fetched. The engine snapshots each version into the checkpoint when a
//! batch is planned with it ([`StaticTable::has_history`] is false), so a rerun, a backfill or a
//! reconcile reads the snapshot rather than files that may have changed since.
//!
//! **Rows.** Every file is read whole, decoded as the files source decodes (JSON lines and CSV,
//! optionally gzipped, with the declared schema; Parquet with its own or the declared one,
//! columns matched by name, a missing nullable column null, values cast strictly). A record
//! that does not decode fails the read, naming the file, the line and why: a dimension table
//! with a broken row is not joined partly. A folder with no files is refused (a wrong path
//! would otherwise join nothing).

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice_engine::storage::{StorageOptions, open_store, read_body};
use sluice_engine::{BoxError, StaticTable};
use tokio::sync::Mutex;
use url::Url;

use crate::decode::{data_lines, decode_csv_file, decode_json_lines};
use crate::files::{FileFormat, decode_parquet, decompress, is_data_file};

/// A folder of files read whole at the listing each batch's intent records.
#[derive(Debug)]
pub struct FilesTable {
    url: Url,
    format: FileFormat,
    /// The declared schema, as SQL column definitions (`None`: Parquet's own).
    declared: Option<String>,
    /// CSV: whether each file starts with a header line.
    header: bool,
    /// CSV: the field delimiter.
    delimiter: u8,
    options: StorageOptions,
    store: Option<(Arc<dyn ObjectStore>, Path)>,
    schema: Option<SchemaRef>,
    /// The newest listing and its version: what [`StaticTable::read`] of that version reads.
    listed: Mutex<Option<(String, Vec<Listed>)>>,
}

/// One listed file.
#[derive(Debug, Clone)]
struct Listed {
    location: Path,
    /// Its name below the table's folder.
    name: String,
    size: u64,
    e_tag: Option<String>,
    /// Microseconds since the epoch.
    modified: i64,
}

impl FilesTable {
    /// The files under `url` in `format`; `schema` (SQL column definitions, `"id BIGINT,
    /// country VARCHAR"`) is required for JSON and CSV. CSV files have a header line and `,`
    /// between fields unless [`FilesTable::with_csv`] says otherwise.
    pub fn new(
        url: Url,
        format: FileFormat,
        schema: Option<String>,
        options: StorageOptions,
    ) -> Self {
        FilesTable {
            url,
            format,
            declared: schema,
            header: true,
            delimiter: b',',
            options,
            store: None,
            schema: None,
            listed: Mutex::new(None),
        }
    }

    /// CSV: whether files start with a header line, and the field delimiter.
    pub fn with_csv(mut self, header: bool, delimiter: u8) -> Self {
        self.header = header;
        self.delimiter = delimiter;
        self
    }

    fn store(&self) -> Result<&(Arc<dyn ObjectStore>, Path), BoxError> {
        self.store
            .as_ref()
            .ok_or_else(|| format!("table {} used before open()", self.url).into())
    }

    /// The table's files, sorted by name; refused if there are none.
    async fn list(&self) -> Result<Vec<Listed>, BoxError> {
        let (store, prefix) = self.store()?;
        let prefix_text = prefix.as_ref().to_string();
        let mut files: Vec<Listed> = store
            .list(Some(prefix))
            .map_ok(|meta| Listed {
                name: meta
                    .location
                    .as_ref()
                    .strip_prefix(prefix_text.as_str())
                    .unwrap_or(meta.location.as_ref())
                    .trim_start_matches('/')
                    .to_string(),
                size: meta.size,
                e_tag: meta.e_tag.clone(),
                modified: meta.last_modified.timestamp_micros(),
                location: meta.location,
            })
            .try_collect()
            .await?;
        files.retain(|f| f.size > 0 && is_data_file(&f.name));
        files.sort_by(|a, b| a.name.cmp(&b.name));
        if files.is_empty() {
            return Err(format!(
                "table {} has no files (is the path right?); a static table is never joined \
                 empty by mistake",
                self.url
            )
            .into());
        }
        Ok(files)
    }

    /// The version of a listing: the number of files and a hash of the settings and of every
    /// file's name, size and identity.
    fn version_of(&self, files: &[Listed]) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut add = |text: &str| {
            for byte in text.bytes() {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0100_0000_01b3);
            }
        };
        add(&format!(
            "{:?}\t{:?}\t{}\t{}\n",
            self.format, self.declared, self.header, self.delimiter
        ));
        for f in files {
            let identity = f.e_tag.clone().unwrap_or_else(|| f.modified.to_string());
            add(&format!("{}\t{}\t{identity}\n", f.name, f.size));
        }
        format!("{}-{hash:016x}", files.len())
    }

    /// The rows of one file, decoded strictly: any record that does not decode fails it.
    fn decode(
        &self,
        schema: &SchemaRef,
        file: &Listed,
        bytes: Bytes,
    ) -> Result<Vec<RecordBatch>, BoxError> {
        let name = &file.name;
        let fail = |what: String| -> BoxError {
            format!("file {name} of table {}: {what}", self.url).into()
        };
        if self.format == FileFormat::Parquet {
            return decode_parquet(schema, None, bytes).map_err(fail);
        }
        let (bytes, cut_off) = decompress(name, bytes);
        if let Some(error) = cut_off {
            return Err(fail(format!("the file ends early ({error})")));
        }
        let (good, bad) = match self.format {
            // A table's schema is always declared.
            FileFormat::Csv => decode_csv_file(schema, self.delimiter, &bytes, self.header, true),
            _ => decode_json_lines(schema, None, &bytes, &data_lines(&bytes, false), false),
        };
        if let Some((line, _, reason)) = bad.first() {
            return Err(fail(format!(
                "line {line} does not decode ({reason}){}",
                match bad.len() {
                    1 => String::new(),
                    n => format!(", nor do {} more lines", n - 1),
                }
            )));
        }
        Ok(good.into_iter().map(|(batch, _)| batch).collect())
    }
}

#[async_trait]
impl StaticTable for FilesTable {
    async fn open(&mut self) -> Result<SchemaRef, BoxError> {
        self.store = Some(open_store(&self.url, &self.options)?);
        if self.url.scheme() == "file"
            && let Ok(dir) = self.url.to_file_path()
            && !dir.is_dir()
        {
            return Err(format!("table folder '{}' does not exist", dir.display()).into());
        }
        let schema = match (&self.declared, self.format) {
            (Some(ddl), _) => sluice_engine::schema::parse_schema(ddl).await?,
            (None, FileFormat::Parquet) => {
                let files = self.list().await?;
                let (store, _) = self.store()?;
                let first = &files[0];
                let bytes = store.get(&first.location).await?.bytes().await?;
                let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)
                    .map_err(|e| format!("file {} of table {}: {e}", first.name, self.url))?;
                Arc::clone(builder.schema())
            }
            (None, _) => {
                return Err(format!(
                    "a JSON or CSV table needs its columns declared: schema = \"id BIGINT, …\" \
                     (table {})",
                    self.url
                )
                .into());
            }
        };
        self.schema = Some(Arc::clone(&schema));
        Ok(schema)
    }

    async fn latest_version(&self) -> Result<String, BoxError> {
        let files = self.list().await?;
        let version = self.version_of(&files);
        *self.listed.lock().await = Some((version.clone(), files));
        Ok(version)
    }

    async fn read(&self, version: &str) -> Result<Vec<RecordBatch>, BoxError> {
        let listed = self.listed.lock().await.clone();
        let files = match listed {
            Some((v, files)) if v == version => files,
            _ => {
                let files = self.list().await?;
                let now = self.version_of(&files);
                if now != version {
                    return Err(format!(
                        "the files of table {} changed since version {version} was listed (they \
                         are version {now} now), and plain files keep no history",
                        self.url
                    )
                    .into());
                }
                files
            }
        };
        let schema = self
            .schema
            .clone()
            .ok_or_else(|| format!("table {} used before open()", self.url))?;
        let (store, _) = self.store()?;
        let mut rows = Vec::new();
        for file in &files {
            let got = store.get(&file.location).await?;
            let changed = got.meta.size != file.size
                || (file.e_tag.is_some() && got.meta.e_tag != file.e_tag);
            if changed {
                return Err(format!(
                    "file {} of table {} changed while version {version} was read",
                    file.name, self.url
                )
                .into());
            }
            let bytes = read_body(got).await?;
            rows.extend(self.decode(&schema, file, bytes)?);
        }
        Ok(rows.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    fn has_history(&self) -> bool {
        false
    }

    fn location(&self) -> String {
        self.url.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(dir: &std::path::Path, format: FileFormat, schema: &str) -> FilesTable {
        FilesTable::new(
            Url::from_directory_path(dir).unwrap(),
            format,
            Some(schema.to_string()),
            StorageOptions::default(),
        )
    }

    #[tokio::test]
    async fn versions_follow_the_files_and_the_settings_and_reads_check_them() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.csv"), "id,name\n1,kettle\n2,lamp\n").unwrap();
        // Hidden and underscore folders, and empty objects, are not the table's.
        std::fs::create_dir_all(dir.path().join("_temporary/0")).unwrap();
        std::fs::write(dir.path().join("_temporary/0/part.csv"), "id,name\n9,x\n").unwrap();
        std::fs::write(dir.path().join(".a.csv.swp"), "junk").unwrap();
        std::fs::write(dir.path().join("empty.csv"), "").unwrap();
        let mut users = table(dir.path(), FileFormat::Csv, "id BIGINT, name VARCHAR");
        users.open().await.unwrap();
        let v1 = users.latest_version().await.unwrap();
        assert!(v1.starts_with("1-"), "{v1}");
        let rows = users.read(&v1).await.unwrap();
        assert_eq!(rows.iter().map(RecordBatch::num_rows).sum::<usize>(), 2);
        // Same files, same version; another setting, another version.
        assert_eq!(users.latest_version().await.unwrap(), v1);
        let mut headerless =
            table(dir.path(), FileFormat::Csv, "id BIGINT, name VARCHAR").with_csv(false, b',');
        headerless.open().await.unwrap();
        assert_ne!(headerless.latest_version().await.unwrap(), v1);
        // A new file: a new version; the old one can no longer be read from the files.
        std::fs::write(dir.path().join("b.csv"), "id,name\n3,mug\n").unwrap();
        let v2 = users.latest_version().await.unwrap();
        assert!(v2.starts_with("2-"), "{v2}");
        let err = users.read(&v1).await.unwrap_err().to_string();
        assert!(err.contains("changed since version"), "{err}");
        // A record that does not decode fails the read, naming the file and the line.
        std::fs::write(dir.path().join("b.csv"), "id,name\n3,mug\nfour,cup\n").unwrap();
        let v3 = users.latest_version().await.unwrap();
        let err = users.read(&v3).await.unwrap_err().to_string();
        assert!(
            err.contains("file b.csv") && err.contains("line 3"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_missing_or_empty_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut missing = table(&dir.path().join("nope"), FileFormat::Json, "id BIGINT");
        let err = missing.open().await.unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        let mut empty = table(dir.path(), FileFormat::Json, "id BIGINT");
        empty.open().await.unwrap();
        let err = empty.latest_version().await.unwrap_err().to_string();
        assert!(err.contains("has no files"), "{err}");
    }
}
