//! A Delta table joined whole by a streaming query (`[tables.NAME] kind = "delta"`): an
//! implementation of [`sluice_engine::StaticTable`]. It lives beside the Delta sink because
//! this is the crate that links delta-rs.
//!
//! Its version is the Delta table version: the batch intent records the newest at planning, and
//! the batch reads the table *at that version* (time travel), so a rerun joins the same rows
//! even if the table has been written since. A version removed by `VACUUM` or log cleanup
//! cannot be read, and the batch fails saying so rather than joining another version.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use deltalake::DeltaTable;
use sluice_engine::storage::StorageOptions;
use sluice_engine::{BoxError, StaticTable};
use tokio::sync::Mutex;
use url::Url;

use crate::delta::{register_cloud_stores, table_frame};
use crate::error::SinkError;

/// A Delta table read whole at the version each batch's intent records.
#[derive(Debug)]
pub struct DeltaTableSource {
    url: Url,
    options: StorageOptions,
    /// The table as last brought up to date (`None` before [`StaticTable::open`]).
    table: Mutex<Option<DeltaTable>>,
}

impl DeltaTableSource {
    /// The Delta table at `url` (a local directory or an object-store URL), opened with
    /// `options` (credentials, endpoint; see [`StorageOptions`]).
    pub fn new(url: Url, options: StorageOptions) -> Self {
        DeltaTableSource {
            url,
            options,
            table: Mutex::new(None),
        }
    }

    fn err(&self, source: deltalake::DeltaTableError) -> BoxError {
        Box::new(SinkError::Delta {
            table: self.url.to_string(),
            source,
        })
    }
}

#[async_trait]
impl StaticTable for DeltaTableSource {
    async fn open(&mut self) -> Result<SchemaRef, BoxError> {
        register_cloud_stores();
        let table =
            deltalake::open_table_with_storage_options(self.url.clone(), self.options.to_map())
                .await
                .map_err(|e| self.err(e))?;
        // The schema rows are read in (partition columns included), not the log's.
        let provider = table
            .table_provider()
            .await
            .map_err(|e| self.err(e.into()))?;
        let schema = provider.schema();
        *self.table.lock().await = Some(table);
        Ok(schema)
    }

    async fn latest_version(&self) -> Result<String, BoxError> {
        let mut guard = self.table.lock().await;
        let table = guard
            .as_mut()
            .ok_or_else(|| format!("table {} used before open()", self.url))?;
        table.update_state().await.map_err(|e| self.err(e))?;
        let version = table
            .version()
            .ok_or_else(|| format!("table {} has no version", self.url))?;
        Ok(version.to_string())
    }

    async fn read(&self, version: &str) -> Result<Vec<RecordBatch>, BoxError> {
        let version: u64 = version
            .parse()
            .map_err(|_| format!("'{version}' is not a Delta table version"))?;
        let mut table = self
            .table
            .lock()
            .await
            .clone()
            .ok_or_else(|| format!("table {} used before open()", self.url))?;
        if table.version() != Some(version) {
            table.load_version(version).await.map_err(|e| self.err(e))?;
        }
        let df = table_frame(&table).await.map_err(|e| self.err(e))?;
        let rows = df.collect().await.map_err(|e| self.err(e.into()))?;
        Ok(rows.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    fn location(&self) -> String {
        self.url.to_string()
    }
}
