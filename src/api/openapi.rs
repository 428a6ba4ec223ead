//! The OpenAPI 3.1 description of this API, served at `/openapi.json`.
//!
//! `openapi.json` beside this file holds everything but the reactions: the
//! names a vote may carry and the totals a body reports are filled in here
//! from the one declaration in `domain::reaction`, so the contract can never
//! disagree with what the handlers do.

use std::sync::OnceLock;

use serde_json::{Map, Value, json};

use crate::domain::Reaction;

const TEMPLATE: &str = include_str!("openapi.json");

/// The document, built once.
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| match build() {
        Ok(doc) => doc,
        // The template is compiled in and checked by a unit test, so this
        // only guards against a broken build: serve it unfilled.
        Err(e) => {
            tracing::error!(error = %e, "the OpenAPI template is malformed");
            TEMPLATE.to_owned()
        }
    })
}

fn build() -> Result<String, String> {
    let mut doc: Value = serde_json::from_str(TEMPLATE).map_err(|e| e.to_string())?;
    let schemas = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
        .ok_or("no components.schemas")?;
    let names: Vec<&str> = Reaction::ALL.iter().map(|r| r.as_str()).collect();
    for (schema, field) in [
        ("VoteRequest", "action"),
        ("VoteResponse", "user_state"),
        ("Counts", "user_state"),
    ] {
        let property = schemas
            .get_mut(schema)
            .and_then(|s| s.pointer_mut(&format!("/properties/{field}")))
            .and_then(Value::as_object_mut)
            .ok_or(format!("no {schema}.{field}"))?;
        property.insert("enum".into(), json!(names));
    }
    for (schema, minimum) in [("VoteResponse", true), ("Counts", true), ("Totals", false)] {
        let object = schemas
            .get_mut(schema)
            .and_then(Value::as_object_mut)
            .ok_or(format!("no {schema}"))?;
        add_totals(object, minimum).map_err(|e| format!("{schema}: {e}"))?;
    }
    serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())
}

/// Adds one required integer property per counted reaction. Served totals
/// never go below zero; a reconcile report's totals are what was stored.
fn add_totals(object: &mut Map<String, Value>, minimum: bool) -> Result<(), &'static str> {
    for name in Reaction::total_names() {
        let mut property = json!({"type": "integer"});
        if minimum {
            property["minimum"] = json!(0);
        }
        object
            .get_mut("properties")
            .and_then(Value::as_object_mut)
            .ok_or("no properties")?
            .insert(name.into(), property);
        object
            .get_mut("required")
            .and_then(Value::as_array_mut)
            .ok_or("no required")?
            .push(json!(name));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_names_every_declared_reaction_and_total() {
        let doc: Value = build()
            .and_then(|d| serde_json::from_str(&d).map_err(|e| e.to_string()))
            .unwrap_or_else(|e| panic!("{e}"));
        let schemas = &doc["components"]["schemas"];
        let action = &schemas["VoteRequest"]["properties"]["action"]["enum"];
        for r in Reaction::ALL {
            assert!(
                action
                    .as_array()
                    .is_some_and(|a| a.contains(&json!(r.as_str()))),
                "{r}"
            );
        }
        for name in Reaction::total_names() {
            for schema in ["VoteResponse", "Counts", "Totals"] {
                assert_eq!(
                    schemas[schema]["properties"][name]["type"], "integer",
                    "{schema}.{name}"
                );
                let required = schemas[schema]["required"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                assert!(required.contains(&json!(name)), "{schema} requires {name}");
            }
        }
    }
}
