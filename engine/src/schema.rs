//! Parses a schema written as SQL column definitions: `id BIGINT, name VARCHAR, ts TIMESTAMP`.
//!
//! Job files state schemas the way users write tables, so the parsing is DataFusion's own SQL
//! type mapping rather than a second dialect of ours.

use std::sync::Arc;

use arrow::datatypes::{Schema, SchemaRef};
use datafusion::prelude::SessionContext;

use crate::error::{Error, Result};

/// Parses `ddl` (column definitions separated by commas) into an Arrow schema.
///
/// # Errors
/// If the text is not a list of `name TYPE` pairs DataFusion understands, quoting it.
pub async fn parse_schema(ddl: &str) -> Result<SchemaRef> {
    let ctx = SessionContext::new();
    let plan = ctx
        .state()
        .create_logical_plan(&format!("CREATE TABLE schema_check ({ddl})"))
        .await
        .map_err(|e| Error::InvalidJob(format!("schema \"{ddl}\" is not valid: {e}")))?;
    let input = plan.inputs();
    let schema = input
        .first()
        .map(|p| p.schema().as_arrow().clone())
        .ok_or_else(|| Error::InvalidJob(format!("schema \"{ddl}\" declares no columns")))?;
    if schema.fields().is_empty() {
        return Err(Error::InvalidJob(format!(
            "schema \"{ddl}\" declares no columns"
        )));
    }
    Ok(Arc::new(Schema::new(schema.fields().clone())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::DataType;

    #[tokio::test]
    async fn sql_types_map_to_arrow() {
        let schema = parse_schema("id BIGINT, amount DOUBLE, name VARCHAR, ts TIMESTAMP")
            .await
            .unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64);
        assert!(matches!(
            schema.field(3).data_type(),
            DataType::Timestamp(_, None)
        ));
    }

    #[tokio::test]
    async fn bad_schema_is_quoted() {
        let err = parse_schema("id WIBBLE").await.unwrap_err().to_string();
        assert!(err.contains("id WIBBLE"), "{err}");
    }
}
