//! Window joins: two windowed aggregates joined on their windows (Nexmark q8).
//!
//! ```sql
//! SELECT P.id, P.name, P.window_start
//! FROM (SELECT id, name, window_start, window_end
//!       FROM tumble(person, date_time, INTERVAL '10' SECOND)
//!       GROUP BY id, name, window_start, window_end) P
//! JOIN (SELECT seller, window_start, window_end
//!       FROM tumble(auction, date_time, INTERVAL '10' SECOND)
//!       GROUP BY seller, window_start, window_end) A
//!   ON P.id = A.seller AND P.window_start = A.window_start AND P.window_end = A.window_end
//! ```
//!
//! Each side is a `StatefulAggregate` (see [`super::aggregate`]) of its own (`0-aggregate` the
//! left, `1-aggregate` the right, each with its state files), run in append mode: a window is
//! emitted once, in the batch whose new watermark passes its end plus the allowed lateness.
//! Both aggregates close windows on the **job's** watermark with the same allowed lateness, and
//! the join equates the sides' window ends (or starts, the windows being of one size), so a
//! window and every window it can join with close in the same batch. The join therefore runs over the windows the batch
//! closed and keeps no state of its own: each batch's output is exactly the SQL join of the
//! windows it closed, and every window is closed once. Outer, semi and anti joins hold for the
//! same reason (a window's partner, if any, closes with it). The window columns the join
//! equates are traced to the `tumble`/`hop` view, so a column the query computes under the
//! name `window_end` does not pass for one. A group whose output a side fails to compute is
//! that side's dead letter and takes no part in the join (an outer join then writes its partner
//! unmatched).
//!
//! What runs above the join sees only the windows a batch closes, so it must work per window,
//! as above an aggregate (an outer aggregate grouped by the window, a window function
//! partitioned by it; not over an outer join, whose unmatched windows have the other side's
//! window columns null). Rows late for a side's window go to the late table with their
//! [`crate::late::SOURCE`] and the windows they missed.

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::utils::split_conjunction;
use datafusion::logical_expr::{BinaryExpr, Expr, JoinType, LogicalPlan, Operator};
use datafusion::prelude::SessionContext;

use super::aggregate::{StatefulAggregate, StatefulSettings, check_upper, plan_stateful};
use super::{OperatorDescription, QueryOutput, reads_stream, single_source};
use crate::error::{Error, Result};
use crate::late::Lateness;
use crate::sink::OutputMode;
use crate::window::{WINDOW_END, WINDOW_START, WindowKind, WindowUse};

/// The tables the part above the join reads each side's closed windows from.
const LEFT_WINDOWS: &str = "__sluice_left_windows";
const RIGHT_WINDOWS: &str = "__sluice_right_windows";
/// What DataFusion calls the plan of a `tumble(…)` or `hop(…)` call (the alias it puts over the
/// view that computes `window_start` and `window_end`).
const WINDOW_VIEWS: [&str; 2] = ["tumble()", "hop()"];

/// A join of two windowed aggregates on their windows: both aggregates, and what runs over
/// the windows each batch closes.
pub(crate) struct WindowJoin {
    /// The left side's aggregate and what runs above it up to the join, then the right's.
    sides: [StatefulAggregate; 2],
    /// The query with each side replaced by the table of the windows it closed this batch.
    upper: LogicalPlan,
    /// Those tables, with their schemas.
    closed: [(Arc<MemTable>, SchemaRef); 2],
    /// The join's condition as written, for `sluice validate`.
    condition: String,
}

impl std::fmt::Debug for WindowJoin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowJoin")
            .field("sides", &self.sides)
            .field("condition", &self.condition)
            .finish()
    }
}

/// Whether the join of two streams `found` joins aggregates over them: a window join.
pub(crate) fn joins_aggregates(found: &LogicalPlan, statics: &BTreeSet<String>) -> bool {
    let LogicalPlan::Join(join) = found else {
        return false;
    };
    let aggregates = |side: &LogicalPlan| {
        let mut found = false;
        let _ = side.apply(|node| {
            if let LogicalPlan::Aggregate(a) = node
                && reads_stream(&a.input, statics)
            {
                found = true;
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        });
        found
    };
    aggregates(&join.left) && aggregates(&join.right)
}

/// Plans the window join `found` in `plan`: each side's aggregate (over the side's own window
/// call, `uses` filtered to its source) and the part above the join.
///
/// # Errors
/// If the sides are not windowed aggregates of one source each in append mode, or the join does
/// not equate their windows so that both close together, naming what to change.
pub(crate) async fn plan_window_join(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    found: &LogicalPlan,
    uses: &[WindowUse],
    settings: StatefulSettings<'_>,
) -> Result<WindowJoin> {
    let refuse = |why: String| Error::UnsupportedQuery(format!("window join: {why}"));
    let LogicalPlan::Join(join) = found else {
        return Err(refuse("not a join".into()));
    };
    if settings.mode != OutputMode::Append {
        return Err(refuse(
            "a join of two aggregates runs in append mode: each window is joined once, when it \
             closes; set mode = \"append\" in [sink]"
                .into(),
        ));
    }
    let mut sources = Vec::new();
    for (name, side) in [("left", &join.left), ("right", &join.right)] {
        sources.push(single_source(side, settings.statics).map_err(|read| {
            refuse(format!(
                "each side of a window join aggregates one source; the {name} side reads {read}"
            ))
        })?);
    }
    let of_first: Vec<&WindowUse> = uses.iter().filter(|u| u.source == sources[0]).collect();
    if sources[0] == sources[1] && of_first.windows(2).any(|pair| pair[0] != pair[1]) {
        return Err(refuse(format!(
            "both sides aggregate source '{}' over different windows; a window join of one \
             source with itself uses one window definition, so that a row late for one side is \
             late for the other",
            sources[0]
        )));
    }
    let mut sides = Vec::new();
    for ((name, side), source) in [("left", &join.left), ("right", &join.right)]
        .into_iter()
        .zip(&sources)
    {
        let own: Vec<WindowUse> = uses
            .iter()
            .filter(|u| u.source == *source)
            .cloned()
            .collect();
        let aggregate = plan_stateful(ctx, side, &own, settings)
            .await?
            .ok_or_else(|| refuse(format!("the {name} side keeps no state")))?;
        match aggregate.window() {
            None => {
                return Err(refuse(format!(
                    "the {name} side is an aggregate without a window; a window join joins two \
                     aggregates over tumble(…) or hop(…) windows"
                )));
            }
            Some((w, _)) if matches!(w.kind, WindowKind::Session { .. }) => {
                return Err(refuse(
                    "a join of session windows is not built: a session's bounds are known only \
                     when it closes, and the two sides' sessions need not close together"
                        .into(),
                ));
            }
            Some(_) => {}
        }
        sides.push(aggregate);
    }
    let [left, right]: [StatefulAggregate; 2] =
        sides.try_into().map_err(|_| refuse("two sides".into()))?;
    let (left_window, right_window) = match (left.window(), right.window()) {
        (Some((l, _)), Some((r, _))) => (l.clone(), r.clone()),
        _ => return Err(refuse("a side without a window".into())),
    };

    // Both sides' windows must close in the same batch: the join equates their ends (or their
    // starts, the windows being of one size).
    let mut pairs: Vec<(Expr, Expr)> = join.on.clone();
    if let Some(filter) = &join.filter {
        for conjunct in split_conjunction(filter) {
            if let Expr::BinaryExpr(BinaryExpr {
                left: l,
                op: Operator::Eq,
                right: r,
            }) = conjunct
            {
                pairs.push((l.as_ref().clone(), r.as_ref().clone()));
                pairs.push((r.as_ref().clone(), l.as_ref().clone()));
            }
        }
    }
    let same_size = left_window.kind.size() == right_window.kind.size();
    let tied = pairs.iter().any(|(l, r)| {
        match (window_column(&join.left, l), window_column(&join.right, r)) {
            (Some(WINDOW_END), Some(WINDOW_END)) => true,
            (Some(WINDOW_START), Some(WINDOW_START)) => same_size,
            _ => false,
        }
    });
    if !tied {
        return Err(refuse(
            "the join must equate the two sides' windows — their window_end columns (or \
             window_start, for windows of one size) — so that a window and its partners close \
             in the same batch; without that a side's closed windows would have to wait in state \
             for the other side's, which is not built"
                .into(),
        ));
    }

    // The part above: the join over the tables of each batch's closed windows.
    let (left_table, left_schema, left_scan) = super::stand_in(LEFT_WINDOWS, join.left.schema())?;
    let (right_table, right_schema, right_scan) =
        super::stand_in(RIGHT_WINDOWS, join.right.schema())?;
    let mut over_closed = join.clone();
    over_closed.left = Arc::new(left_scan);
    over_closed.right = Arc::new(right_scan);
    let upper = super::replace_node(plan, found, &LogicalPlan::Join(over_closed))?;
    check_upper(&upper, OutputMode::Append, &[LEFT_WINDOWS, RIGHT_WINDOWS])?;
    let outer = matches!(
        join.join_type,
        JoinType::Left | JoinType::Right | JoinType::Full
    );
    let per_window = upper.exists(|node| {
        Ok(matches!(
            node,
            LogicalPlan::Aggregate(_) | LogicalPlan::Window(_) | LogicalPlan::Distinct(_)
        ))
    })?;
    if outer && per_window {
        return Err(refuse(format!(
            "an aggregate, DISTINCT or window function over an outer window join ({}) is not built: a \
             window without partner has the other side's window columns null, so grouping by \
             them would gather windows of different batches",
            join.join_type
        )));
    }

    let mut condition: Vec<String> = join.on.iter().map(|(l, r)| format!("{l} = {r}")).collect();
    condition.extend(join.filter.iter().map(ToString::to_string));
    Ok(WindowJoin {
        sides: [left, right],
        upper,
        closed: [(left_table, left_schema), (right_table, right_schema)],
        condition: format!("{} JOIN ON {}", join.join_type, condition.join(" AND ")),
    })
}

/// The window column (`window_start` or `window_end`) that `expr`, a column of `side`'s output,
/// passes on unchanged through projections, aliases, filters and as a group column of
/// aggregates, traced down to the `tumble`/`hop` view that computes it (a projection over the
/// source's scan, or over the unnested list of a hop's windows; see [`WINDOW_VIEWS`]) — not a
/// column of that name the query computed itself.
fn window_column(side: &LogicalPlan, expr: &Expr) -> Option<&'static str> {
    let Expr::Column(column) = expr else {
        return None;
    };
    let mut index = side.schema().index_of_column(column).ok()?;
    let mut node = side;
    loop {
        match node {
            LogicalPlan::Projection(p) => {
                let Expr::Column(c) = p.expr.get(index)?.clone().unalias() else {
                    return None;
                };
                index = p.input.schema().index_of_column(&c).ok()?;
                node = &p.input;
            }
            // DataFusion names a table function's plan after the call: the window's view.
            LogicalPlan::SubqueryAlias(a) if WINDOW_VIEWS.contains(&a.alias.table()) => {
                let name = a.schema.field(index).name();
                return [WINDOW_START, WINDOW_END].into_iter().find(|w| name == w);
            }
            LogicalPlan::SubqueryAlias(a) => node = &a.input,
            // A static table joined on the side: the column comes from one of the inputs.
            LogicalPlan::Join(j) => {
                let left_width = j.left.schema().fields().len();
                node = match j.join_type {
                    JoinType::LeftSemi | JoinType::LeftAnti => &j.left,
                    JoinType::RightSemi | JoinType::RightAnti => &j.right,
                    _ if index < left_width => &j.left,
                    _ => {
                        index -= left_width;
                        &j.right
                    }
                };
            }
            LogicalPlan::Filter(f) => node = &f.input,
            LogicalPlan::Aggregate(a) => {
                let Expr::Column(c) = a.group_expr.get(index)? else {
                    return None;
                };
                index = a.input.schema().index_of_column(c).ok()?;
                node = &a.input;
            }
            _ => return None,
        }
    }
}

impl WindowJoin {
    /// The two aggregates, left then right.
    pub(crate) fn sides(&self) -> &[StatefulAggregate; 2] {
        &self.sides
    }

    /// The two aggregates, to run a batch's rows through.
    pub(crate) fn sides_mut(&mut self) -> [&mut StatefulAggregate; 2] {
        let [left, right] = &mut self.sides;
        [left, right]
    }

    /// The window and lateness rows of `source` are aggregated over (the left side's, if both
    /// sides read it: one window, checked at planning).
    pub(crate) fn window_of(&self, source: &str) -> Option<(&WindowUse, Lateness)> {
        self.sides
            .iter()
            .filter_map(StatefulAggregate::window)
            .find(|(w, _)| w.source == source)
    }

    /// The sources the sides read, left first, each once.
    pub(crate) fn sources(&self) -> Vec<&str> {
        let mut sources: Vec<&str> = Vec::new();
        for (w, _) in self.sides.iter().filter_map(StatefulAggregate::window) {
            if !sources.contains(&w.source.as_str()) {
                sources.push(&w.source);
            }
        }
        sources
    }

    /// Both aggregates as operators 0 and 1 of the chain, then the join over their windows.
    pub(crate) fn describe(&self) -> Vec<OperatorDescription> {
        let mut described: Vec<OperatorDescription> = self
            .sides
            .iter()
            .enumerate()
            .map(|(i, a)| a.describe(i))
            .collect();
        described.push(OperatorDescription {
            id: "2-window_join".into(),
            what: format!(
                "window join of 0-aggregate and 1-aggregate: {}",
                self.condition
            ),
            state_key: Vec::new(),
            purge: "no state of its own: a window and its partners close in the same batch (the \
                    join equates their windows, both close on the job's watermark)"
                .into(),
            emits: "the joined windows once, in the batch that closes them".into(),
        });
        described
    }

    /// Emits the windows both sides close under `watermark` and joins them (see the module
    /// doc). The groups a side fails to finish are dead letters, as for an aggregate.
    ///
    /// # Errors
    /// If the join or what runs above it fails: on values, the batch fails with a message
    /// naming the query part (every window pair of the batch needs it).
    pub(crate) async fn emit(
        &mut self,
        ctx: &SessionContext,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        let left = self.sides[0].emit(ctx, watermark).await?;
        let right = self.sides[1].emit(ctx, watermark).await?;
        self.join(ctx, left, right).await
    }

    /// The end of a bounded run: every window of both sides, joined.
    ///
    /// # Errors
    /// As [`WindowJoin::emit`].
    pub(crate) async fn emit_all(&mut self, ctx: &SessionContext) -> Result<QueryOutput> {
        let left = self.sides[0].emit_all(ctx).await?;
        let right = self.sides[1].emit_all(ctx).await?;
        self.join(ctx, left, right).await
    }

    /// Runs the part above the join over both sides' closed windows.
    async fn join(
        &self,
        ctx: &SessionContext,
        left: QueryOutput,
        right: QueryOutput,
    ) -> Result<QueryOutput> {
        let mut out = QueryOutput::default();
        out.failed.extend(left.failed);
        out.failed.extend(right.failed);
        if left.batches.is_empty() && right.batches.is_empty() {
            return Ok(out);
        }
        for ((table, schema), rows) in self.closed.iter().zip([left.batches, right.batches]) {
            let rows = rows
                .into_iter()
                .map(|b| {
                    Ok(RecordBatch::try_new(
                        Arc::clone(schema),
                        b.columns().to_vec(),
                    )?)
                })
                .collect::<Result<Vec<_>>>()?;
            *table.batches[0].write().await = rows;
        }
        let joined = match ctx.execute_logical_plan(self.upper.clone()).await {
            Ok(df) => df.collect().await,
            Err(e) => Err(e),
        };
        for (table, _) in &self.closed {
            table.batches[0].write().await.clear();
        }
        let joined = joined.map_err(|e| {
            Error::UnsupportedQuery(format!(
                "the query over the joined windows failed: {e} — every window pair of the batch \
                 is needed together there, so no single row can be set aside; compute the \
                 failing expression inside one side's aggregate query instead"
            ))
        })?;
        out.batches = joined.into_iter().filter(|b| b.num_rows() > 0).collect();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use arrow::array::{Array, AsArray, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema, TimestampMicrosecondType};
    use proptest::prelude::*;

    use super::*;
    use crate::event_time::event_time_type;
    use crate::operators::test_support::stream;
    use crate::query::{QuerySettings, StreamingQuery};

    const SECOND: i64 = 1_000_000;
    const SIZE: i64 = 10;
    const OUT_OF_ORDERNESS: i64 = 5;

    /// One event: (event time in seconds, key).
    type Event = (i64, u8);

    /// Counts per key and 10 s window on each side, joined on the key and the window.
    fn sql(join: &str) -> String {
        let side = |source: &str| {
            format!(
                "SELECT k, window_start, window_end, count(*) AS n \
                 FROM tumble({source}, ts, INTERVAL '10' SECOND) \
                 GROUP BY k, window_start, window_end"
            )
        };
        format!(
            "SELECT L.k, L.window_start, L.n AS ln, R.n AS rn FROM ({}) L {join} ({}) R \
             ON L.k = R.k AND L.window_end = R.window_end",
            side("l"),
            side("r")
        )
    }

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("ts", event_time_type(), false),
            Field::new("k", DataType::Utf8, false),
        ]))
    }

    fn batch(events: &[Event]) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        events.iter().map(|e| e.0 * SECOND),
                    )
                    .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from_iter_values(
                    events.iter().map(|e| format!("k{}", e.1)),
                )),
            ],
        )
        .unwrap()
    }

    fn settings() -> QuerySettings {
        QuerySettings {
            lineage: false,
            event_time: BTreeMap::from([
                ("l".to_string(), "ts".to_string()),
                ("r".to_string(), "ts".to_string()),
            ]),
            ..QuerySettings::default()
        }
    }

    fn watermark_after(before: Option<i64>, chunks: &[Vec<Event>; 2]) -> Option<i64> {
        chunks
            .iter()
            .flatten()
            .map(|e| (e.0 - OUT_OF_ORDERNESS) * SECOND)
            .chain(before)
            .max()
    }

    /// One output row: key, window start (s), left count, right count (-1: null).
    type Joined = (String, i64, i64, i64);

    /// What the rules say: a row whose window is closed under the watermark in force is late;
    /// every window closed under the final watermark is emitted, with its partner's counts
    /// (a left join keeps a left window without partner). The sorted rows and the late count.
    fn model(batches: &[[Vec<Event>; 2]], left_join: bool) -> (Vec<Joined>, usize) {
        let mut counts: [BTreeMap<(u8, i64), i64>; 2] = [BTreeMap::new(), BTreeMap::new()];
        let mut late = 0;
        let mut watermark = None;
        let closed = |start: i64, wm: Option<i64>| wm.is_some_and(|w| (start + SIZE) * SECOND <= w);
        for chunks in batches {
            for s in 0..2 {
                for &(ts, k) in &chunks[s] {
                    let start = ts.div_euclid(SIZE) * SIZE;
                    if closed(start, watermark) {
                        late += 1;
                    } else {
                        *counts[s].entry((k, start)).or_default() += 1;
                    }
                }
            }
            watermark = watermark_after(watermark, chunks);
        }
        let mut rows = Vec::new();
        for (&(k, start), &n) in &counts[0] {
            if !closed(start, watermark) {
                continue;
            }
            match counts[1].get(&(k, start)) {
                Some(&m) => rows.push((format!("k{k}"), start, n, m)),
                None if left_join => rows.push((format!("k{k}"), start, n, -1)),
                None => {}
            }
        }
        rows.sort();
        (rows, late)
    }

    /// The query streamed over `batches`, restarted from its state files after batch
    /// `restart_after`: the sorted rows it emitted and the late rows, each checked to name its
    /// source.
    async fn streamed(
        sql: &str,
        batches: &[[Vec<Event>; 2]],
        restart_after: usize,
    ) -> (Vec<Joined>, usize) {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut inputs = Vec::new();
        let mut watermarks = Vec::new();
        let mut watermark = None;
        for chunks in batches {
            inputs.push(BTreeMap::from([
                ("l".to_string(), batch(&chunks[0])),
                ("r".to_string(), batch(&chunks[1])),
            ]));
            watermark = watermark_after(watermark, chunks);
            watermarks.push(watermark);
        }
        let streamed = stream(
            sql,
            &sources,
            &settings(),
            &inputs,
            &watermarks,
            restart_after,
        )
        .await;
        assert_eq!(streamed.operator_ids, ["0-aggregate", "1-aggregate"]);
        let mut late = 0;
        for (name, l) in &streamed.late {
            let sources = l.column_by_name(crate::late::SOURCE).unwrap();
            assert!(
                sources
                    .as_string::<i32>()
                    .iter()
                    .all(|s| s == Some(name.as_str()))
            );
            late += l.num_rows();
        }
        let mut rows = Vec::new();
        for b in &streamed.outputs {
            let keys = b.column(0).as_string::<i32>();
            let starts = b.column(1).as_primitive::<TimestampMicrosecondType>();
            let (ln, rn) = (
                b.column(2).as_primitive::<Int64Type>(),
                b.column(3).as_primitive::<Int64Type>(),
            );
            for r in 0..b.num_rows() {
                let right = if rn.is_null(r) { -1 } else { rn.value(r) };
                rows.push((
                    keys.value(r).to_string(),
                    starts.value(r) / SECOND,
                    ln.value(r),
                    right,
                ));
            }
        }
        rows.sort();
        (rows, late)
    }

    fn events() -> impl Strategy<Value = Vec<[Vec<Event>; 2]>> {
        let side = || prop::collection::vec((0i64..120, 0u8..4), 0..12);
        prop::collection::vec((side(), side()).prop_map(|(l, r)| [l, r]), 1..8)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Every window closed under the final watermark is joined with its partner once, with
        /// the on-time rows of both sides counted, and late rows go to the late table with
        /// their source — straight through and across a restart from the state files after
        /// any batch, for an inner and a left join.
        #[test]
        fn each_closed_window_pair_is_joined_once(batches in events(), restart in 0usize..8) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            for left_join in [false, true] {
                let sql = sql(if left_join { "LEFT JOIN" } else { "JOIN" });
                let (expected, late) = model(&batches, left_join);
                let (rows, streamed_late) = runtime.block_on(streamed(&sql, &batches, restart));
                prop_assert_eq!(&rows, &expected, "{}", sql);
                prop_assert_eq!(streamed_late, late);
            }
        }
    }

    /// A window join shows both aggregates and the join in `sluice validate`; joins that do
    /// not tie the windows together, or run in update mode, are refused with the reason.
    #[tokio::test]
    async fn window_joins_are_described_and_untied_windows_refused() {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let query = StreamingQuery::plan(sql("JOIN").as_str(), &sources, &settings())
            .await
            .unwrap();
        let ids: Vec<String> = query.operators().into_iter().map(|o| o.id).collect();
        assert_eq!(ids, ["0-aggregate", "1-aggregate", "2-window_join"]);

        let untied = sql("JOIN").replace("AND L.window_end = R.window_end", "");
        let e = StreamingQuery::plan(untied.as_str(), &sources, &settings())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("must equate the two sides' windows"), "{e}");

        // Starts of windows of different sizes close at different times.
        let sizes = sql("JOIN")
            .replacen("INTERVAL '10' SECOND", "INTERVAL '20' SECOND", 1)
            .replace(
                "L.window_end = R.window_end",
                "L.window_start = R.window_start",
            );
        let e = StreamingQuery::plan(sizes.as_str(), &sources, &settings())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("must equate the two sides' windows"), "{e}");

        // A column the query computes under the name window_end is not the window's end.
        let computed = sql("JOIN").replacen(
            "FROM tumble(l, ts, INTERVAL '10' SECOND)",
            "FROM (SELECT k, window_start, window_start + INTERVAL '20' SECOND AS window_end \
             FROM (SELECT k, window_start FROM tumble(l, ts, INTERVAL '10' SECOND)))",
            1,
        );
        let e = StreamingQuery::plan(computed.as_str(), &sources, &settings())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("must equate the two sides' windows"), "{e}");

        // Over an outer join, a window without partner has null window columns on one side.
        let outer = format!(
            "SELECT window_start, count(*) FROM ({}) GROUP BY window_start",
            sql("LEFT JOIN")
        );
        let e = StreamingQuery::plan(outer.as_str(), &sources, &settings())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("over an outer window join"), "{e}");

        let update = QuerySettings {
            output_mode: crate::sink::OutputMode::Update,
            ..settings()
        };
        let e = StreamingQuery::plan(sql("JOIN").as_str(), &sources, &update)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("append mode"), "{e}");
    }
}
