#!/usr/bin/env python3
"""Writes grafana/prefix-router.json, the Grafana dashboard, from the panel
list below (rows in the order an on-call engineer opens them). Every query is
run against a real Prometheus by tests/dashboard.rs.
  scripts/dashboard.py
"""
import json
import pathlib

SERVER_ERRORS = 'kind=~"no_replica|upstream_error|upstream_timeout|overloaded|internal_error"'


def q(expr, legend):
    return (expr, legend)


def quantiles(metric, by, label):
    return [q(f'histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket[5m])))',
              f'{{{{{label}}}}} p{int(p * 100)}') for p in (0.5, 0.95)]


ROWS = [
    ("Traffic and errors", [
        ("Requests/s by replica", "reqps",
         "Routed requests that got a replica's answer, per replica.",
         [q('sum by (replica) (rate(prefix_router_requests_total[1m]))', '{{replica}}')]),
        ("Router errors/s by kind", "reqps",
         "Errors the router answered itself (OpenAI-style JSON), by kind: no_replica, "
         "upstream_error/timeout (replica failed), overloaded (limits), replicas_saturated "
         "(shed_in_flight), body_too_large, body_timeout, invalid_api_key.",
         [q('sum by (kind) (rate(prefix_router_errors_total[5m]))', '{{kind}}')]),
        ("Server error ratio", "percentunit",
         "Router-answered server errors over all answers (the PrefixRouterErrorRate alert).",
         [q(f'sum(rate(prefix_router_errors_total{{{SERVER_ERRORS}}}[5m])) / '
            f'clamp_min(sum(rate(prefix_router_requests_total[5m])) + '
            f'sum(rate(prefix_router_errors_total{{{SERVER_ERRORS}}}[5m])), 1e-9)', 'errors')]),
        ("No live replica (503s)", "short",
         "Requests that arrived while no replica was live.",
         [q('increase(prefix_router_no_replica_total[5m])', 'no_replica')]),
    ]),
    ("Placement", [
        ("Requests/s by decision", "reqps",
         "pin: continuation sent to the replica holding its prefix; prefix: single sent to the "
         "replica holding most of its prompt (a shared system prompt); spread: counter; fallback: "
         "pinned replica down; key: explicit conversation key; guard: load guard moved it; "
         "hash: affinity mode with no match, or fleet: rendezvous.",
         [q('sum by (decision) (rate(prefix_router_requests_total[1m]))', '{{decision}}')]),
        ("Requests/s by model", "reqps",
         "Routed requests by the model they named (as the replicas list it; `unlisted`: a model "
         "no replica lists, `none`: no model field).",
         [q('sum by (model) (rate(prefix_router_model_requests_total[1m]))', '{{model}}')]),
        ("Continuations pinned (share)", "percentunit",
         "Share of continuations that went to the replica holding their prefix (pin or key), or "
         "by their conversation's hash (fleet: rendezvous).",
         [q('sum(rate(prefix_router_requests_total{shape="continuation",decision=~"pin|key|hash"}[5m])) '
            '/ sum(rate(prefix_router_requests_total{shape="continuation"}[5m]))', 'pinned')]),
        ("Time to first byte by decision (p50, p95)", "s",
         "From request arrival to the replica's first response body bytes: the router's view "
         "of time to first token. Pins should be fast (cached prefill); spread is cold prefill.",
         quantiles('prefix_router_first_byte_seconds', 'decision', 'decision')),
        ("Request duration by decision (p50, p95)", "s",
         "From request arrival to the end of the replica's response.",
         quantiles('prefix_router_request_duration_seconds', 'decision', 'decision')),
    ]),
    ("Failures and health", [
        ("Replica up", "short",
         "1: health check passing and not ejected. Drained: taken out of service through the "
         "admin API (no request is placed there).",
         [q('prefix_router_replica_up', '{{replica}}'),
          q('prefix_router_replica_drained', '{{replica}} drained')]),
        ("Failovers and ejections", "short",
         "Failovers: requests moved to another replica after a connect failure (never after "
         "the replica got the request). Ejections: replicas taken out by the request path.",
         [q('sum by (replica) (increase(prefix_router_failovers_total[5m]))', '{{replica}} failovers'),
          q('sum by (replica, reason) (increase(prefix_router_ejections_total[5m]))',
            '{{replica}} ejected ({{reason}})')]),
        ("In-flight requests", "short",
         "Requests the router has at each replica now, and held under limits.",
         [q('prefix_router_in_flight_requests', '{{replica}}'),
          q('prefix_router_admitted_requests', 'admitted (limits.max_requests)')]),
        ("Prompt queued for prefill", "short",
         "Prompt tokens of the streams sent to each replica that have not answered yet, less "
         "what their placement expected cached: cold placements go where it is least "
         "(queued_prefill_step_bytes).",
         [q('prefix_router_queued_prefill_tokens', '{{replica}}')]),
        ("Time to replica response header (all)", "s",
         "From request arrival to the replica's response head, all replicas.",
         [q(f'histogram_quantile({p}, sum by (le) (rate(prefix_router_upstream_header_seconds_bucket[5m])))',
            f'p{int(p * 100)}') for p in (0.5, 0.9, 0.99)]),
    ]),
    ("Capacity", [
        ("KV: capacity, router working set, engine usage", "short",
         "capacity: config kv_tokens; working set: distinct prompt tokens the router placed on "
         "the replica within working_set_window_s (above capacity it thrashes under any "
         "policy); pinned: of which continuations.",
         [q('prefix_router_replica_kv_capacity_tokens', '{{replica}} capacity'),
          q('prefix_router_replica_working_set_tokens', '{{replica}} working set'),
          q('prefix_router_replica_pinned_working_set_tokens', '{{replica}} pinned working set')]),
        ("Engine KV in use (vLLM)", "percentunit",
         "The engine's own share of KV cache in use (scraped from the replicas).",
         [q('vllm:kv_cache_usage_perc', '{{instance}}')]),
        ("Engine queue (vLLM)", "short",
         "Requests running and waiting at each engine (scraped from the replicas).",
         [q('vllm:num_requests_running', '{{instance}} running'),
          q('vllm:num_requests_waiting', '{{instance}} waiting')]),
        ("Load per replica: the router's in flight vs the engine's own (engine_load)", "short",
         "With engine_load on: what each engine reported (running + waiting; KV used 0-1).",
         [q('prefix_router_engine_requests', '{{replica}} engine requests'),
          q('prefix_router_engine_kv_used_ratio', '{{replica}} engine KV used')]),
        ("Engine metric reads by result (failed/unrecognised: own counts in force)", "reqps",
         "Reads of each replica's /metrics by engine_load.",
         [q('sum by (replica, result) (rate(prefix_router_engine_reads_total[5m]))',
            '{{replica}} {{result}}')]),
    ]),
    ("Cache hits", [
        ("Cached tokens: predicted by the router vs reported by the engine", "short",
         "Over responses that reported usage: tokens the router expected cached (matched "
         "bytes / 4), tokens the engine reported cached, and prompt tokens.",
         [q('sum by (replica) (rate(prefix_router_predicted_cached_tokens_total[5m]))', '{{replica}} predicted'),
          q('sum by (replica) (rate(prefix_router_delivered_cached_tokens_total[5m]))', '{{replica}} delivered'),
          q('sum by (replica) (rate(prefix_router_reported_prompt_tokens_total[5m]))', '{{replica}} prompt')]),
        ("Pin outcomes and index repairs", "short",
         "hit: the engine reported at least half the predicted tokens cached; repairs: the index "
         "forgot a replica's entries (miss: a lost pin; restart: it came back from a failed check).",
         [q('sum by (outcome) (rate(prefix_router_pin_outcomes_total[5m]))', '{{outcome}}'),
          q('sum by (replica, cause) (increase(prefix_router_index_repairs_total[5m]))', '{{replica}} repair ({{cause}})')]),
        ("Engine prefix cache hit rate (vLLM)", "percentunit",
         "The engine's own prefix-cache hits over queries.",
         [q('sum by (instance) (rate(vllm:prefix_cache_hits_total[5m])) / '
            'sum by (instance) (rate(vllm:prefix_cache_queries_total[5m]))', '{{instance}}')]),
        ("Index fidelity: delivered / predicted cached tokens", "short",
         "Cached tokens the engines reported over those the router predicted, by replica and by "
         "decision (1: the router knew; below: it guessed held what was gone; above: it did not "
         "know what was held). A replica whose KV events are read and known (events: 1) is placed "
         "by what its engine holds, the others by the router's own index.",
         [q('sum by (replica) (rate(prefix_router_delivered_cached_tokens_total[5m])) / '
            'sum by (replica) (rate(prefix_router_predicted_cached_tokens_total[5m]))', '{{replica}}'),
          q('sum by (decision) (rate(prefix_router_delivered_cached_tokens_total[5m])) / '
            'sum by (decision) (rate(prefix_router_predicted_cached_tokens_total[5m]))', '{{decision}}'),
          q('max by (replica) (prefix_router_kv_synced)', '{{replica}} events known')]),
    ]),
    ("Tenants", [
        ("Requests/s by tenant", "reqps",
         "Requests admitted per tenant (tenants: an API key's tenant=, the tenant header, "
         "else the key; names only a header gave show as other).",
         [q('sum by (tenant) (rate(prefix_router_tenant_requests_total[1m]))', '{{tenant}}')]),
        ("429s/s by tenant and limit", "reqps",
         "Requests refused by a tenant's limit: concurrency (max_concurrent), requests "
         "(requests_per_minute), tokens (prompt_tokens_per_minute).",
         [q('sum by (tenant, limit) (rate(prefix_router_tenant_refused_total[1m]))',
            '{{tenant}} {{limit}}')]),
        ("Prompt tokens/min by tenant", "short",
         "Prompt tokens charged to each tenant: the engines' reported counts, else the "
         "router's estimate.",
         [q('sum by (tenant) (rate(prefix_router_tenant_prompt_tokens_total[5m])) * 60',
            '{{tenant}}')]),
        ("Requests in progress by tenant, and waiting", "short",
         "Requests from their head to their end, per tenant (max_concurrent caps it), and "
         "(queue) those waiting for a place under shed_in_flight now.",
         [q('sum by (tenant) (prefix_router_tenant_in_progress_requests)', '{{tenant}}'),
          q('prefix_router_queue_waiting_requests', 'waiting in the queue')]),
        ("Queue wait p90 by tenant", "s",
         "With queue: the p90 of the time each tenant's routed requests waited for a place "
         "(0 for those that went on at once). A flooding tenant waits; the others should not.",
         [q('histogram_quantile(0.9, sum by (le, tenant) '
            '(rate(prefix_router_tenant_queue_wait_seconds_bucket[5m])))', '{{tenant}}')]),
    ]),
    ("Config and index", [
        ("Config reloads", "short",
         "Reloads of the config file and the keys files (API, admin), by result.",
         [q('sum by (result) (increase(prefix_router_config_reloads_total[1h]))', 'config {{result}}'),
          q('sum by (result) (increase(prefix_router_api_keys_reloads_total[1h]))', 'keys {{result}}')]),
        ("Prefix index and response ids", "short",
         "Entries (1 KiB blocks, prompt ends, keys) and heap bytes of the prefix index; "
         "Responses API ids whose replica the router knows.",
         [q('prefix_router_prefix_index_entries', 'entries'),
          q('prefix_router_prefix_index_bytes', 'bytes'),
          q('prefix_router_response_ids', 'response ids')]),
        ("Request body size (p50, p95)", "bytes",
         "Body bytes of routed requests.",
         [q(f'histogram_quantile({p}, sum by (le) (rate(prefix_router_request_body_bytes_bucket[5m])))',
            f'p{int(p * 100)}') for p in (0.5, 0.95)]),
        ("Long bodies read from a checkpoint", "percentunit",
         "Of chat bodies of 32 KiB and more, the share read from where the conversation's "
         "last turn ended (a checkpoint) rather than from the first byte; low with agent "
         "traffic means limits.max_checkpoint_bytes is too small for the conversations in "
         "flight (compare the bytes held with it).",
         [q('sum(rate(prefix_router_long_body_parses_total{from="checkpoint"}[5m])) / '
            'sum(rate(prefix_router_long_body_parses_total[5m]))', 'from a checkpoint')]),
        ("Checkpoint bytes", "bytes",
         "Bytes held by checkpoints of long conversations' latest turns "
         "(bounded by limits.max_checkpoint_bytes).",
         [q('prefix_router_checkpoint_bytes', 'held')]),
        ("KV events: blocks held, batches, engine resets", "short",
         "Per replica with kv_events: the GPU blocks its engine reports holding, batches read by "
         "outcome, and engine resets (a clear, a restart) seen in the last hour.",
         [q('max by (replica) (prefix_router_kv_blocks)', '{{replica}} blocks'),
          q('sum by (outcome) (rate(prefix_router_kv_event_batches_total[5m]))', 'batches {{outcome}}/s'),
          q('sum by (replica) (increase(prefix_router_kv_engine_resets_total[1h]))', '{{replica}} resets (1h)')]),
    ]),
]


def main():
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (ptitle, unit, desc, queries) in enumerate(row):
            panels.append({
                "id": pid, "type": "timeseries", "title": ptitle, "description": desc,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": 12 * (i % 2), "y": y + 8 * (i // 2), "w": 12, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"refId": chr(ord("A") + j), "expr": e, "legendFormat": lf}
                            for j, (e, lf) in enumerate(queries)],
            })
            pid += 1
        y += 8 * ((len(row) + 1) // 2)
    dash = {
        "title": "prefix-router", "uid": "prefix-router", "schemaVersion": 39, "version": 2,
        "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "tags": ["llm", "prefix-router"],
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }
    out = pathlib.Path(__file__).resolve().parent.parent / "grafana" / "prefix-router.json"
    out.write_text(json.dumps(dash, indent=2) + "\n")
    print(f"wrote {out}: {sum(p['type'] != 'row' for p in panels)} panels in {len(ROWS)} rows")


if __name__ == "__main__":
    main()
