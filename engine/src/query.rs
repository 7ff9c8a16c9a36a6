//! The job's SQL, planned once and executed once per batch with DataFusion.
//!
//! Each source is registered as an in-memory table whose contents are swapped before every
//! batch, so the logical plan is built (and validated) once. Execution is vectorised and
//! parallel: a batch's rows are split across DataFusion's target partitions.
//!
//! A query-time error caused by some rows (a failing `CAST`) must not stall the job. For the
//! stateless queries run here, output is row-local, so [`StreamingQuery::execute_isolating`]
//! splits the input in halves until the failing rows are found; they become dead letters and the
//! rest proceeds. An error that occurs with no input at all is not about data and stops the job.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::catalog::MemTable;
use datafusion::common::Column;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Expr, LogicalPlan, Projection};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::error::{Error, Result};
use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};

/// A row on which the query failed, with the error.
#[derive(Debug)]
pub struct FailedRow {
    /// The source table the row came from.
    pub source: String,
    /// The row, as a one-row batch of that source's schema.
    pub row: RecordBatch,
    /// What DataFusion said.
    pub error: String,
}

/// Output of one execution, after isolating failing rows.
#[derive(Debug, Default)]
pub struct QueryOutput {
    /// Output rows.
    pub batches: Vec<RecordBatch>,
    /// Input rows on which the query failed.
    pub failed: Vec<FailedRow>,
}

/// The job's query, planned against the source schemas.
pub struct StreamingQuery {
    ctx: SessionContext,
    tables: BTreeMap<String, (SchemaRef, Arc<MemTable>)>,
    plan: LogicalPlan,
    partitions: usize,
}

impl std::fmt::Debug for StreamingQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingQuery")
            .field("plan", &self.plan.display_indent().to_string())
            .finish()
    }
}

impl StreamingQuery {
    /// Plans `sql` over tables named after the sources, with the given batch schemas.
    ///
    /// With `lineage`, the output carries the lineage columns `_source_partition` and
    /// `_source_offset` even when the SELECT list does not name them.
    ///
    /// # Errors
    /// If the SQL does not parse or plan (unknown table or column, type error), or needs state
    /// across batches (aggregates, joins, windows, ORDER BY, LIMIT, DISTINCT).
    pub async fn plan(sql: &str, sources: &[(String, SchemaRef)], lineage: bool) -> Result<Self> {
        let config = SessionConfig::new().with_information_schema(false);
        let partitions = config.target_partitions().max(1);
        let ctx = SessionContext::new_with_config(config);
        let mut tables = BTreeMap::new();
        for (name, schema) in sources {
            let empty = (0..partitions).map(|_| Vec::new()).collect();
            let table = Arc::new(MemTable::try_new(Arc::clone(schema), empty)?);
            ctx.register_table(name.as_str(), Arc::clone(&table) as _)?;
            tables.insert(name.clone(), (Arc::clone(schema), table));
        }
        let providers = tables
            .iter()
            .map(|(name, (_, table))| (name.clone(), Arc::clone(table) as _))
            .collect();
        crate::window::register(&ctx, &providers);
        let plan = ctx.state().create_logical_plan(sql).await?;
        check_stateless(&plan)?;
        let plan = if lineage { carry_lineage(plan)? } else { plan };
        if lineage {
            let schema = plan.schema();
            for col in [SOURCE_PARTITION, SOURCE_OFFSET] {
                if !schema.fields().iter().any(|f| f.name() == col) {
                    return Err(Error::UnsupportedQuery(format!(
                        "lineage is on, but the query's output cannot carry the column {col}; \
                         set lineage = false in [sink] to write without lineage"
                    )));
                }
            }
        }
        Ok(StreamingQuery {
            ctx,
            tables,
            plan,
            partitions,
        })
    }

    /// The schema of the rows the query produces.
    pub fn output_schema(&self) -> SchemaRef {
        Arc::new(self.plan.schema().as_arrow().clone())
    }

    /// The optimised logical plan, for `sluice validate`.
    pub fn display_plan(&self) -> Result<String> {
        let optimized = self.ctx.state().optimize(&self.plan)?;
        Ok(optimized.display_indent_schema().to_string())
    }

    /// Runs the query over one batch of input per source.
    ///
    /// # Errors
    /// Any DataFusion error; see [`StreamingQuery::execute_isolating`] for the caller that keeps
    /// going past bad rows.
    pub async fn execute(
        &self,
        inputs: &BTreeMap<String, RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        for (name, (_, table)) in &self.tables {
            let rows = inputs.get(name);
            for (i, slot) in table.batches.iter().enumerate() {
                let mut slot = slot.write().await;
                slot.clear();
                if let Some(rows) = rows {
                    let chunk = rows.num_rows().div_ceil(self.partitions);
                    let offset = i * chunk;
                    if offset < rows.num_rows() {
                        slot.push(rows.slice(offset, chunk.min(rows.num_rows() - offset)));
                    }
                }
            }
        }
        let df = self.ctx.execute_logical_plan(self.plan.clone()).await?;
        let batches = df.collect().await?;
        Ok(batches.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// Runs the query; if it fails, finds the failing rows by splitting the input and runs the
    /// rest.
    ///
    /// # Errors
    /// If the query fails even with no input (not a data problem).
    pub async fn execute_isolating(
        &self,
        inputs: &BTreeMap<String, RecordBatch>,
    ) -> Result<QueryOutput> {
        match self.execute(inputs).await {
            Ok(batches) => {
                return Ok(QueryOutput {
                    batches,
                    failed: vec![],
                });
            }
            Err(e) => {
                if let Err(empty_error) = self.execute(&BTreeMap::new()).await {
                    return Err(Error::UnsupportedQuery(format!(
                        "the query fails even without input rows: {empty_error} (first seen as: {e})"
                    )));
                }
            }
        }
        // Stateless output is row-local: run each source alone and bisect the failing ranges.
        let mut out = QueryOutput::default();
        for (name, rows) in inputs {
            let mut pending = vec![(0usize, rows.num_rows())];
            while let Some((offset, len)) = pending.pop() {
                if len == 0 {
                    continue;
                }
                let part = BTreeMap::from([(name.clone(), rows.slice(offset, len))]);
                match self.execute(&part).await {
                    Ok(batches) => out.batches.extend(batches),
                    Err(e) if len == 1 => out.failed.push(FailedRow {
                        source: name.clone(),
                        row: rows.slice(offset, 1),
                        error: e.to_string(),
                    }),
                    Err(_) => {
                        let half = len / 2;
                        pending.push((offset + half, len - half));
                        pending.push((offset, half));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Rejects plans whose result would depend on how the input is split into batches.
fn check_stateless(plan: &LogicalPlan) -> Result<()> {
    let mut problem = None;
    plan.apply(|node| {
        let allowed = matches!(
            node,
            LogicalPlan::Projection(_)
                | LogicalPlan::Filter(_)
                | LogicalPlan::TableScan(_)
                | LogicalPlan::SubqueryAlias(_)
                | LogicalPlan::Union(_)
                | LogicalPlan::Unnest(_)
                | LogicalPlan::EmptyRelation(_)
                | LogicalPlan::Values(_)
        );
        if allowed {
            Ok(TreeNodeRecursion::Continue)
        } else {
            problem = Some(node.display().to_string());
            Ok(TreeNodeRecursion::Stop)
        }
    })?;
    match problem {
        None => Ok(()),
        Some(node) => Err(Error::UnsupportedQuery(format!(
            "`{node}` needs state across batches; streaming jobs currently run stateless queries \
             only (SELECT with expressions, WHERE, UNION ALL, UNNEST): no aggregates, joins, \
             windows, ORDER BY, LIMIT or DISTINCT"
        ))),
    }
}

/// Adds the lineage columns to every projection whose input has them and whose output lacks them.
fn carry_lineage(plan: LogicalPlan) -> Result<LogicalPlan> {
    let rewritten = plan.transform_up(|node| {
        let node = node.recompute_schema()?;
        let LogicalPlan::Projection(projection) = node else {
            return Ok(Transformed::no(node));
        };
        let present: HashSet<&str> = projection
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let mut expr = projection.expr.clone();
        for name in [SOURCE_PARTITION, SOURCE_OFFSET] {
            if present.contains(name) {
                continue;
            }
            if let Ok((qualifier, _)) = projection
                .input
                .schema()
                .qualified_field_with_unqualified_name(name)
            {
                expr.push(Expr::Column(Column::new(qualifier.cloned(), name)));
            }
        }
        if expr.len() == projection.expr.len() {
            return Ok(Transformed::no(LogicalPlan::Projection(projection)));
        }
        let projection = Projection::try_new(expr, Arc::clone(&projection.input))?;
        Ok(Transformed::yes(LogicalPlan::Projection(projection)))
    })?;
    Ok(rewritten.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    /// A source batch of `code` strings with lineage columns (partition "0", given offsets).
    fn code_batch(codes: Vec<String>, offsets: Vec<i64>) -> (SchemaRef, RecordBatch) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("code", DataType::Utf8, true),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        let n = codes.len();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(codes)),
                Arc::new(StringArray::from(vec!["0"; n])),
                Arc::new(Int64Array::from(offsets)),
            ],
        )
        .unwrap();
        (schema, batch)
    }

    fn source() -> (SchemaRef, RecordBatch) {
        let codes = ["1", "2", "x", "4", "y", "6"].map(String::from).to_vec();
        code_batch(codes, vec![0, 0, 1, 1, 2, 2])
    }

    #[tokio::test]
    async fn failing_rows_are_isolated_and_the_rest_proceeds() {
        let (schema, batch) = source();
        let query = StreamingQuery::plan(
            "SELECT CAST(code AS INT) AS n FROM t",
            &[("t".into(), schema)],
            true,
        )
        .await
        .unwrap();
        let out_schema = query.output_schema();
        let names: Vec<&str> = out_schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, vec!["n", SOURCE_PARTITION, SOURCE_OFFSET]);
        let inputs = BTreeMap::from([("t".to_string(), batch)]);
        let out = query.execute_isolating(&inputs).await.unwrap();
        let rows: usize = out.batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(rows, 4);
        let failed: Vec<String> = out
            .failed
            .iter()
            .map(|f| {
                f.row
                    .column(0)
                    .as_any()
                    .downcast_ref::<StringArray>()
                    .unwrap()
                    .value(0)
                    .to_string()
            })
            .collect();
        assert_eq!(failed, vec!["x", "y"]);
        assert!(
            out.failed[0].error.contains("Cannot cast"),
            "{}",
            out.failed[0].error
        );
    }

    fn rows_of(batches: &[RecordBatch]) -> Vec<String> {
        let mut rows = Vec::new();
        for b in batches {
            let formatted =
                arrow::util::pretty::pretty_format_batches(std::slice::from_ref(b)).unwrap();
            rows.extend(
                formatted
                    .to_string()
                    .lines()
                    .skip(3)
                    .filter(|l| !l.starts_with('+'))
                    .map(str::to_string),
            );
        }
        rows.sort();
        rows
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(32))]
        /// However the input is split into batches, the streamed output (the union of the
        /// batches' outputs) and the dead-lettered rows equal one run over all the input.
        #[test]
        fn any_batch_split_gives_the_batch_result(
            codes in proptest::collection::vec(prop_oneof![
                (0i32..1000).prop_map(|n| n.to_string()),
                "[a-z]{1,3}",
            ], 1..60),
            cuts in proptest::collection::vec(0usize..60, 0..6),
        ) {
            let n = codes.len();
            let (schema, all) = code_batch(codes, (0..n as i64).collect());
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let query = rt.block_on(StreamingQuery::plan(
                "SELECT CAST(code AS INT) * 2 AS doubled, upper(code) AS code FROM t WHERE length(code) < 4",
                &[("t".into(), schema)],
                true,
            )).unwrap();
            let run = |batch: RecordBatch| {
                let out = rt.block_on(query.execute_isolating(&BTreeMap::from([("t".to_string(), batch)]))).unwrap();
                let failed: Vec<i64> = out.failed.iter().map(|f| f.row.column(2).as_any().downcast_ref::<Int64Array>().unwrap().value(0)).collect();
                (out.batches, failed)
            };
            let (whole, mut whole_failed) = run(all.clone());
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(n)).chain([0, n]).collect();
            bounds.sort_unstable();
            bounds.dedup();
            let mut streamed = Vec::new();
            let mut streamed_failed = Vec::new();
            for w in bounds.windows(2) {
                let (out, failed) = run(all.slice(w[0], w[1] - w[0]));
                streamed.extend(out);
                streamed_failed.extend(failed);
            }
            whole_failed.sort_unstable();
            streamed_failed.sort_unstable();
            prop_assert_eq!(rows_of(&streamed), rows_of(&whole));
            prop_assert_eq!(streamed_failed, whole_failed);
        }
    }

    #[tokio::test]
    async fn stateful_queries_are_refused_with_a_reason() {
        let (schema, _) = source();
        let err = StreamingQuery::plan("SELECT count(*) FROM t", &[("t".into(), schema)], false)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs state across batches"), "{err}");
    }
}
