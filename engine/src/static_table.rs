//! Static tables: tables a streaming query joins whole (a dimension table — users, products,
//! campaigns), read rather than streamed.
//!
//! A static table is read **at a version**: the batch intent records each table's version (the
//! newest at planning), so a rerun of the batch after a crash joins exactly the rows the first
//! attempt joined, and the manifest repeats it. A newer version is picked up by the next batch
//! that is planned; nothing waits for it. The rows of a version are read once and kept in
//! memory until a batch asks for another version.
//!
//! The join itself is DataFusion's (a hash join inside the batch's plan, see
//! `operators::stateful_node` for which joins a stream may take part in): a stream row
//! meets the table as it was at the batch's version, so the join needs no state across batches,
//! and its output for a row depends only on that row and the version — what lets the engine
//! isolate a failing row, and a rerun repeat the batch.
//!
//! The engine knows no concrete table: a Delta table is `sluice_sinks::DeltaTableSource`
//! (`[tables.NAME] kind = "delta"` in a job file); [`StaticTable`] is the trait to implement
//! for another.

use std::collections::BTreeMap;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;

use crate::error::{BoxError, Error, Result};

/// A table read whole at a version the batch intent records.
#[async_trait]
pub trait StaticTable: Send + Sync + std::fmt::Debug {
    /// Opens the table and returns its schema: the query is planned against it. Called once,
    /// before the query is planned.
    async fn open(&mut self) -> std::result::Result<SchemaRef, BoxError>;

    /// The newest version, as text that [`StaticTable::read`] reads back: recorded in the
    /// intent of the batch being planned (a Delta table's version number, e.g. `"7"`).
    async fn latest_version(&self) -> std::result::Result<String, BoxError>;

    /// Every row of the table at `version`, in the schema [`StaticTable::open`] returned.
    /// Reading the same version again must give the same rows: a rerun relies on it. A version
    /// that can no longer be read (removed by a vacuum) is an error, never another version's
    /// rows.
    async fn read(&self, version: &str) -> std::result::Result<Vec<RecordBatch>, BoxError>;

    /// Where the table is, for messages and `sluice validate`.
    fn location(&self) -> String;
}

/// A static table of a job, under the name its query uses.
#[derive(Debug)]
pub struct TableSpec {
    /// The SQL table name.
    pub name: String,
    /// The table.
    pub table: Box<dyn StaticTable>,
}

/// A job's static tables, opened.
#[derive(Debug, Default)]
pub struct StaticTables {
    tables: Vec<TableSpec>,
    schemas: BTreeMap<String, SchemaRef>,
}

impl StaticTables {
    /// Opens every table; the schemas are what the query is planned against.
    ///
    /// # Errors
    /// [`Error::StaticTable`] naming the table that could not be opened.
    pub async fn open(specs: Vec<TableSpec>) -> Result<StaticTables> {
        let mut tables = StaticTables::default();
        for mut spec in specs {
            let schema = spec
                .table
                .open()
                .await
                .map_err(|e| Error::in_table(&spec.name, e))?;
            tables.schemas.insert(spec.name.clone(), schema);
            tables.tables.push(spec);
        }
        Ok(tables)
    }

    /// Each table's schema, by name.
    pub fn schemas(&self) -> &BTreeMap<String, SchemaRef> {
        &self.schemas
    }

    /// Whether the job has no static table.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// The tables' names.
    pub fn names(&self) -> Vec<String> {
        self.tables.iter().map(|t| t.name.clone()).collect()
    }

    /// Each table's newest version: what the intent of the batch being planned records.
    ///
    /// # Errors
    /// [`Error::StaticTable`] naming the table whose version could not be found.
    pub async fn latest_versions(&self) -> Result<BTreeMap<String, String>> {
        let mut versions = BTreeMap::new();
        for spec in &self.tables {
            let version = spec
                .table
                .latest_version()
                .await
                .map_err(|e| Error::in_table(&spec.name, e))?;
            versions.insert(spec.name.clone(), version);
        }
        Ok(versions)
    }

    /// The rows of table `name` at `version`.
    ///
    /// # Errors
    /// [`Error::StaticTable`] if the table cannot be read at that version or its rows do not
    /// have the schema the query was planned with.
    pub async fn read(&self, name: &str, version: &str) -> Result<Vec<RecordBatch>> {
        let spec =
            self.tables.iter().find(|t| t.name == name).ok_or_else(|| {
                Error::InvalidJob(format!("the job has no static table '{name}'"))
            })?;
        let rows = spec
            .table
            .read(version)
            .await
            .map_err(|e| Error::in_table(name, format!("reading version {version}: {e}")))?;
        let planned = &self.schemas[name];
        let mut conformed = Vec::with_capacity(rows.len());
        for batch in rows {
            let fields = batch.schema();
            let same = fields.fields().len() == planned.fields().len()
                && fields
                    .fields()
                    .iter()
                    .zip(planned.fields())
                    .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
            if !same {
                return Err(Error::in_table(
                    name,
                    format!(
                        "version {version} has the columns {} but the query was planned with {}: \
                         restart the job to plan it against the table's new schema",
                        fields_text(&fields),
                        fields_text(planned)
                    ),
                ));
            }
            let batch =
                RecordBatch::try_new(std::sync::Arc::clone(planned), batch.columns().to_vec())
                    .map_err(|e| Error::in_table(name, format!("version {version}: {e}")))?;
            conformed.push(batch);
        }
        Ok(conformed)
    }
}

fn fields_text(schema: &SchemaRef) -> String {
    let fields: Vec<String> = schema
        .fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect();
    format!("({})", fields.join(", "))
}
