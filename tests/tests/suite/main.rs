//! The integration suite: one test binary, one module per area of the spec.
//! Every test drives the built `flotilla` binary and checks results and counters of its
//! `--json` report.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod admission;
mod agent;
mod anthropic;
mod asks;
mod bundled;
mod claude;
mod cli;
mod cluster;
mod cluster_asks;
mod cluster_bounds;
mod cluster_budgets;
mod cluster_defects;
mod cluster_hosts;
mod cluster_images;
mod cluster_sandbox;
mod cluster_sessions;
mod cluster_sources;
mod cluster_tenant_sources;
mod cluster_tenant_workflows;
mod cluster_tenants;
mod cluster_views;
mod cluster_workers;
mod cluster_workspaces;
mod combinators;
mod day2;
mod defects;
mod deploy;
mod dev;
mod exec;
mod launch_checks;
mod layering;
mod limits;
mod mcp;
mod models;
mod namespaces;
mod openai;
mod operators;
mod resume;
mod script;
mod sources;
mod spec_extra;
mod stall;
mod web;
mod workflows;
