//! A source's schema as its checkpoint records it: the schema it started with (declared, or
//! inferred from the first records and then fixed) and the columns schema evolution added since.
//!
//! ```text
//! sources/<name>/schema.json            the inferred schema (a declared one is not recorded)
//! sources/<name>/inference.json         how it was inferred: per column, the values that did not fit
//! sources/<name>/schemas/00000001.json  evolution 1: the columns added, and where first seen
//! ```
//!
//! Every file is written put-if-absent and never changed, so two runs of the job (a stale twin,
//! a rerun) agree on the schema: a run that finds an evolution recorded by another adopts it.
//! The schema in force is the first one plus every recorded evolution; a read of any offsets
//! decodes with it (columns added later read as null in records from before they appeared).

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use sluice_engine::SchemaInference;
use sluice_engine::checkpoint::CheckpointStore;
use tracing::info;

use crate::error::{ConnectorError, Result};

const SCHEMA_FILE: &str = "schema.json";
const INFERENCE_FILE: &str = "inference.json";
const EVOLUTIONS: &str = "schemas";

/// One schema evolution: the columns a batch's records brought.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Evolution {
    /// 1, 2, …
    pub(crate) version: u64,
    /// The columns added (nullable), or widened in place.
    pub(crate) columns: Vec<Field>,
    /// Where the first record carrying them is (`file.json:17`, `0@42`).
    pub(crate) first_seen: String,
}

fn evolution_name(version: u64) -> String {
    format!("{EVOLUTIONS}/{version:08}.json")
}

/// The schema of one source and its history. See the module docs.
pub(crate) struct SchemaLog {
    checkpoint: CheckpointStore,
    source: String,
    current: SchemaRef,
    inference: Option<SchemaInference>,
    evolutions: Vec<Evolution>,
    /// An inferred schema not yet recorded: `validate` writes nothing, so the first
    /// `available()` of a run records it.
    pending: Option<(SchemaRef, SchemaInference)>,
}

impl SchemaLog {
    /// The schema of a source: `declared` if given, else the recorded one, else `infer()`'s
    /// (recorded by [`SchemaLog::record_pending`]); with every evolution recorded since.
    ///
    /// # Errors
    /// If the checkpoint cannot be read, or inference fails.
    pub(crate) async fn open<F, Fut>(
        checkpoint: CheckpointStore,
        source: &str,
        declared: Option<SchemaRef>,
        infer: F,
    ) -> Result<SchemaLog>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(SchemaRef, SchemaInference)>>,
    {
        let recorded: Option<Schema> = checkpoint.get_json(SCHEMA_FILE).await?;
        let (base, inference, pending) = match (declared, recorded) {
            (Some(declared), _) => (declared, None, None),
            (None, Some(schema)) => {
                let inference = checkpoint.get_json(INFERENCE_FILE).await?;
                (Arc::new(schema), inference, None)
            }
            (None, None) => {
                let (schema, inference) = infer().await?;
                (
                    Arc::clone(&schema),
                    Some(inference.clone()),
                    Some((schema, inference)),
                )
            }
        };
        let mut log = SchemaLog {
            checkpoint,
            source: source.to_string(),
            current: base,
            inference,
            evolutions: Vec::new(),
            pending,
        };
        log.load_evolutions().await?;
        Ok(log)
    }

    /// Reads the evolutions recorded after the ones already applied.
    async fn load_evolutions(&mut self) -> Result<()> {
        loop {
            let next = self.evolutions.len() as u64 + 1;
            let Some(evolution) = self
                .checkpoint
                .get_json::<Evolution>(&evolution_name(next))
                .await?
            else {
                return Ok(());
            };
            self.apply(evolution)?;
        }
    }

    fn apply(&mut self, evolution: Evolution) -> Result<()> {
        self.current = Arc::new(evolved(&self.current, &evolution.columns)?);
        self.evolutions.push(evolution);
        Ok(())
    }

    /// The schema in force.
    pub(crate) fn current(&self) -> SchemaRef {
        Arc::clone(&self.current)
    }

    /// How the first schema was inferred, if it was.
    pub(crate) fn inference(&self) -> Option<&SchemaInference> {
        self.inference.as_ref()
    }

    /// Records an inferred schema not recorded yet (put-if-absent) and logs it; a run finding
    /// another run's different one recorded first must stop (it planned under the other).
    ///
    /// # Errors
    /// If another run fixed a different schema, or the checkpoint cannot be written.
    pub(crate) async fn record_pending(&mut self) -> Result<()> {
        let Some((schema, inference)) = self.pending.take() else {
            return Ok(());
        };
        // The report first: once the schema is recorded, a run never infers again.
        let report = self.checkpoint.to_json(INFERENCE_FILE, &inference)?;
        self.checkpoint
            .put_if_absent(INFERENCE_FILE, report)
            .await?;
        let bytes = self.checkpoint.to_json(SCHEMA_FILE, schema.as_ref())?;
        if !self.checkpoint.put_if_absent(SCHEMA_FILE, bytes).await? {
            let recorded: Option<Schema> = self.checkpoint.get_json(SCHEMA_FILE).await?;
            if recorded.as_ref() != Some(schema.as_ref()) {
                return Err(ConnectorError::Schema(format!(
                    "another run fixed a different inferred schema in {}/{SCHEMA_FILE}; restart \
                     the job to use it",
                    self.checkpoint.url()
                )));
            }
            return Ok(());
        }
        let columns: Vec<String> = inference.columns.iter().map(ToString::to_string).collect();
        info!(source = %self.source, records = inference.records, sample = %inference.sample, columns = %columns.join("; "), "schema inferred and fixed in the checkpoint");
        Ok(())
    }

    /// Adds `columns` to the schema in force — new columns at the end, new fields at the end of
    /// a struct column; a column it already has keeps its type — recorded as the next evolution
    /// (put-if-absent) once `accept` takes the grown schema. Evolutions another run (or another
    /// partition's read) recorded meanwhile are adopted first, so nothing they added is lost;
    /// if nothing is left to add, nothing is recorded. Returns the schema in force.
    ///
    /// # Errors
    /// If `accept` refuses the grown schema, or the checkpoint cannot be read or written.
    pub(crate) async fn evolve(
        &mut self,
        columns: Vec<Field>,
        first_seen: String,
        accept: impl Fn(&SchemaRef) -> Result<()>,
    ) -> Result<SchemaRef> {
        for _ in 0..MAX_RECORD_TRIES {
            self.load_evolutions().await?;
            let grown = Arc::new(evolved(&self.current, &columns)?);
            if grown == self.current {
                return Ok(self.current());
            }
            accept(&grown)?;
            let changed: Vec<Field> = grown
                .fields()
                .iter()
                .filter(|f| self.current.field_with_name(f.name()).ok() != Some(f.as_ref()))
                .map(|f| f.as_ref().clone())
                .collect();
            let evolution = Evolution {
                version: self.evolutions.len() as u64 + 1,
                columns: changed,
                first_seen: first_seen.clone(),
            };
            let rel = evolution_name(evolution.version);
            let bytes = self.checkpoint.to_json(&rel, &evolution)?;
            if self.checkpoint.put_if_absent(&rel, bytes).await? {
                let added: Vec<String> = evolution
                    .columns
                    .iter()
                    .map(|f| format!("{} {}", f.name(), f.data_type()))
                    .collect();
                info!(source = %self.source, version = evolution.version, columns = %added.join(", "), first_seen = %evolution.first_seen, "schema evolved: columns added");
                self.apply(evolution)?;
                return Ok(self.current());
            }
            // Another run recorded this version first: adopt it, and add what it lacks.
        }
        Err(ConnectorError::Schema(format!(
            "could not record a schema evolution in {} after {MAX_RECORD_TRIES} tries: other \
             runs kept recording theirs first",
            self.checkpoint.url()
        )))
    }
}

/// How many times recording an evolution is tried when other runs record theirs first.
const MAX_RECORD_TRIES: usize = 8;

/// `schema` with `columns` added: a new column at the end (nullable), a struct column's new
/// fields at the end of the struct (recursively, also in lists); a column `schema` has keeps
/// its type.
fn evolved(schema: &Schema, columns: &[Field]) -> Result<Schema> {
    fn merge(existing: &Field, added: &Field) -> Field {
        match (existing.data_type(), added.data_type()) {
            (DataType::Struct(old), DataType::Struct(new)) => {
                let mut fields: Vec<Field> = old.iter().map(|f| f.as_ref().clone()).collect();
                for n in new {
                    match fields.iter_mut().find(|f| f.name() == n.name()) {
                        Some(f) => *f = merge(f, n),
                        None => fields.push(n.as_ref().clone().with_nullable(true)),
                    }
                }
                existing
                    .clone()
                    .with_data_type(DataType::Struct(Fields::from(fields)))
            }
            (DataType::List(old), DataType::List(new)) => existing
                .clone()
                .with_data_type(DataType::List(Arc::new(merge(old, new)))),
            _ => existing.clone(),
        }
    }
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    let mut seen = BTreeSet::new();
    for column in columns {
        if !seen.insert(column.name().clone()) {
            return Err(ConnectorError::Schema(format!(
                "column '{}' added twice",
                column.name()
            )));
        }
        match fields.iter_mut().find(|f| f.name() == column.name()) {
            Some(existing) => *existing = merge(existing, column),
            None => fields.push(column.clone().with_nullable(true)),
        }
    }
    Ok(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn user(fields: Vec<Field>) -> Field {
        Field::new_struct("user", fields, true)
    }

    async fn open(checkpoint: &CheckpointStore) -> SchemaLog {
        let declared = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            user(vec![Field::new("name", DataType::Utf8, true)]),
        ]));
        SchemaLog::open(checkpoint.clone(), "s", Some(declared), || async {
            unreachable!("declared")
        })
        .await
        .unwrap()
    }

    /// Two reads evolving at once (one with a stale schema) keep both additions; a column the
    /// schema has keeps its type; a new run opens with every evolution.
    #[tokio::test]
    async fn evolutions_from_a_stale_schema_keep_what_others_added() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let (mut a, mut b) = (open(&checkpoint).await, open(&checkpoint).await);
        let name = Field::new("name", DataType::Utf8, true);
        let email = Field::new("email", DataType::Utf8, true);
        let age = Field::new("age", DataType::Int64, true);
        a.evolve(
            vec![user(vec![name.clone(), email.clone()])],
            "f:1".into(),
            |_| Ok(()),
        )
        .await
        .unwrap();
        let grown = b
            .evolve(
                vec![
                    user(vec![name.clone(), age.clone()]),
                    Field::new("id", DataType::Utf8, true),
                ],
                "f:2".into(),
                |_| Ok(()),
            )
            .await
            .unwrap();
        let wanted = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            user(vec![name, email, age]),
        ]);
        assert_eq!(grown.as_ref(), &wanted);
        assert_eq!(open(&checkpoint).await.current().as_ref(), &wanted);
        // Nothing new: nothing recorded.
        let again = b
            .evolve(
                vec![Field::new("id", DataType::Int64, true)],
                "f:3".into(),
                |_| Err(ConnectorError::Schema("not asked".into())),
            )
            .await
            .unwrap();
        assert_eq!(again.as_ref(), &wanted);
        assert_eq!(b.evolutions.len(), 2);
    }
}
