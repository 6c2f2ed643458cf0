// Data-parallel ranks in one `tandem serve` (--data-parallel-size 2), with real processes
// over loopback: each rank is an engine with its own scheduler, KV pool and transfer
// agent. Greedy output is the same whichever rank serves a request; data_parallel_rank
// picks the rank and an out-of-range one is a 400; prefill/decode works for every
// (prefill rank, decode rank) pair, each consumer rank reading from either producer
// rank's agent; and through `tandem router --dp-aware` every rank is a worker, paired
// freely or index to index. The ranks lend each other their CPUs while idle (not with
// --no-lend-cpus). Started by tests/integration/test_dp.sh.
// No test asserts on timing: deadlines only bound waits for state that must arrive.
import { test, after } from 'node:test';
import { metrics, until, startTandem, postJson, tokenPrompts, refText } from './lib.mjs';
import assert from 'node:assert/strict';
import os from 'node:os';

const BIN = process.env.TD_BIN;
const MODEL = process.env.TD_MODEL;
assert.ok(BIN && MODEL, 'TD_BIN and TD_MODEL must be set');

const procs = new Set();
after(() => { for (const p of procs) p.kill('SIGKILL'); });

const start = (args) => startTandem(BIN, args, procs);

const serve = (extra) => start(['serve', '--model', MODEL, '--threads', '2', '--host', '127.0.0.1',
  '--server-port', '0', '--log-level', 'warn', ...extra]);
const router = (args) => start(['router', '--host', '127.0.0.1', '--port', '0', '--log-level', 'warn',
  '--health-check-interval-secs', '0.2', '--health-check-timeout-secs', '1', ...args]);

const post = (base, body) => postJson(base, '/v1/completions', body);

// Parallel runs with borrowed CPUs, summed over the ranks.
const borrowed = (m) => Object.keys(m).filter((k) => k.startsWith('tandem_cpu_borrowed_runs_total'))
  .reduce((a, k) => a + m[k], 0);

async function idle(base, what) {
  await until(async () => {
    const m = await metrics(base);
    return m.tandem_kv_blocks_used === 0 && m.tandem_num_requests_running === 0 &&
      !Object.keys(m).some((k) => k.startsWith('tandem_kv_leases_active') && m[k] > 0);
  }, `${what}: idle with every KV block back`);
}

const GEN = { max_tokens: 10, temperature: 0, ignore_eos: true };

// Prompts as token ids (BOS first), 1 to 70 tokens (stories260K's context is 128).
const prompts = (n) => tokenPrompts(n, [1, 5, 16, 17, 33, 70], 77);

let ONE, DP, PROD, CONS;
const expected = refText(() => ONE.url, GEN);

test('start: one plain engine, an aggregated server and a producer and consumer of two ranks each', async () => {
  [ONE, DP, PROD, CONS] = await Promise.all([
    serve([]),
    serve(['--data-parallel-size', '2', '--enable-dp-attention']),
    serve(['--dp', '2', '--kv-transfer-config', '{"kv_role":"kv_producer"}']),
    serve(['--dp', '2', '--kv-transfer-config', '{"kv_role":"kv_consumer","transfer_timeout_ms":5000}']),
  ]);
  const info = await (await fetch(DP.url + '/server_info')).json();
  assert.equal(info.dp_size, 2);
  assert.equal((await (await fetch(ONE.url + '/server_info')).json()).dp_size, 1);
  // the producer's two agents, one per rank, on distinct ports
  const kv = await (await fetch(PROD.url + '/kv_transfer_info')).json();
  assert.equal(kv.dp_size, 2);
  assert.equal(kv.dp_ranks.length, 2);
  assert.notEqual(kv.dp_ranks[0].handshake_port, kv.dp_ranks[1].handshake_port);
  assert.notEqual(kv.dp_ranks[0].engine_id, kv.dp_ranks[1].engine_id);
  assert.equal(kv.handshake_port, kv.dp_ranks[0].handshake_port);
});

test('aggregated: the same greedy output on rank 0, rank 1 and the least-loaded rank', async () => {
  const ps = prompts(12);
  for (const p of ps) {
    const w = await expected(p);
    for (const rank of [0, 1, undefined]) {
      const r = await post(DP.url, { prompt: p, ...GEN, ...(rank === undefined ? {} : { data_parallel_rank: rank }) });
      assert.equal(r.status, 200, r.text);
      assert.equal(r.json.choices[0].text, w, `rank ${rank}, ${p.length} tokens`);
    }
  }
  // concurrent requests without a rank spread over both ranks
  const before = await metrics(DP.url);
  await Promise.all(ps.map(async (p) => assert.equal((await post(DP.url, { prompt: p, ...GEN })).json.choices[0].text, await expected(p))));
  const h = await (await fetch(DP.url + '/health')).json();
  assert.equal(h.status, 'ok');
  assert.deepEqual(h.rank_loads, [0, 0]);
  const m = await metrics(DP.url);
  assert.equal(m.tandem_generation_tokens_total - before.tandem_generation_tokens_total, 12 * GEN.max_tokens);
  await idle(DP.url, 'aggregated');
  // A request on one rank, the other idle: it borrowed the idle rank's CPUs (with two CPUs
  // or more, one rank each), and the output above did not change for it.
  if (os.availableParallelism() >= 2) assert.ok(borrowed(m) > 0, 'no rank borrowed an idle CPU');
});

test('--no-lend-cpus keeps each rank on its own CPUs', async () => {
  const s = await serve(['--dp', '2', '--no-lend-cpus']);
  const p = prompts(1)[0];
  const r = await post(s.url, { prompt: p, ...GEN, data_parallel_rank: 1 });
  assert.equal(r.json.choices[0].text, await expected(p));
  assert.equal(borrowed(await metrics(s.url)), 0);
  s.proc.kill('SIGKILL');
});

test('data_parallel_rank out of range, or of the wrong type, is a 400 that names it', async () => {
  for (const [v, msg] of [[2, /has 2 data-parallel ranks/], [-1, /data_parallel_rank/], ['0', /data_parallel_rank/], [1.5, /data_parallel_rank/]]) {
    const r = await post(DP.url, { prompt: [1, 5], max_tokens: 2, data_parallel_rank: v });
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json.error.param, 'data_parallel_rank');
    assert.match(r.json.error.message, msg);
  }
  const one = await post(ONE.url, { prompt: [1, 5], max_tokens: 2, data_parallel_rank: 1 });
  assert.equal(one.status, 400, one.text);
  assert.match(one.json.error.message, /has 1 data-parallel rank \(0\.\.0\)/);
  assert.equal((await post(ONE.url, { prompt: [1, 5], max_tokens: 2, data_parallel_rank: 0 })).status, 200);
});

test('prefill/decode for every (prefill rank, decode rank) pair: the output of one engine', async () => {
  const ps = prompts(6);
  const agents = (await (await fetch(PROD.url + '/kv_transfer_info')).json()).dp_ranks;
  for (const pr of [0, 1]) {
    for (const dr of [0, 1]) {
      for (const p of ps) {
        const a = await post(PROD.url, { prompt: p, max_tokens: 1, temperature: 0, data_parallel_rank: pr,
          kv_transfer_params: { do_remote_decode: true, do_remote_prefill: false } });
        assert.equal(a.status, 200, a.text);
        const kv = a.json.kv_transfer_params;
        assert.equal(kv.do_remote_prefill, true, a.text);
        assert.equal(kv.dp_rank, pr);
        assert.equal(kv.remote_handshake_port, agents[pr].handshake_port, 'the agent of the rank that holds the KV');
        assert.equal(kv.remote_engine_id, agents[pr].engine_id);
        const b = await post(CONS.url, { prompt: p, ...GEN, data_parallel_rank: dr, kv_transfer_params: kv });
        assert.equal(b.status, 200, b.text);
        assert.equal(b.json.choices[0].text, await expected(p), `prefill rank ${pr}, decode rank ${dr}, ${p.length} tokens`);
        assert.equal(b.json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(b.json.kv_transfer_params));
      }
    }
  }
  // each consumer rank read from both producer ranks: per-rank transfer counters
  const m = await metrics(CONS.url);
  for (const r of [0, 1]) assert.equal(m[`tandem_kv_transfers_total{dp_rank="${r}"}`], 2 * ps.length, `consumer rank ${r}`);
  await idle(PROD.url, 'producer');
  await idle(CONS.url, 'consumer');
});

test('through the router with --dp-aware: every rank is a worker; none and idx2idx pairing', async () => {
  for (const mapping of ['none', 'idx2idx']) {
    const r = await router(['--pd-disaggregation', '--prefill', PROD.url, '--decode', CONS.url, '--dp-aware',
      '--policy', 'round_robin', '--atom-pd-rank-mapping-policy', mapping]);
    await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
    const ws = await until(async () => (await (await fetch(r.url + '/workers')).json()).workers.length === 4, 'a worker per rank')
      .then(async () => (await (await fetch(r.url + '/workers')).json()).workers);
    assert.deepEqual(ws.map((w) => `${w.role}@${w.dp_rank}`).sort(), ['decode@0', 'decode@1', 'prefill@0', 'prefill@1']);
    assert.deepEqual(ws.filter((w) => w.role === 'prefill').map((w) => w.name).sort(), [`${PROD.url}@0`, `${PROD.url}@1`]);
    const before = await metrics(CONS.url);
    const ps = prompts(8);
    await Promise.all(ps.map(async (p) => {
      const res = await post(r.url, { prompt: p, ...GEN });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.choices[0].text, await expected(p));
    }));
    const after = await metrics(CONS.url);
    const done = (k) => after[`tandem_kv_transfers_total{dp_rank="${k}"}`] - before[`tandem_kv_transfers_total{dp_rank="${k}"}`];
    assert.equal(done(0) + done(1), ps.length);
    assert.ok(done(0) > 0 && done(1) > 0, `both decode ranks took requests (${done(0)}, ${done(1)})`);
    const w2 = (await (await fetch(r.url + '/workers')).json()).workers;
    const n = (role, rank) => w2.find((w) => w.role === role && w.dp_rank === rank).requests;
    if (mapping === 'idx2idx') for (const k of [0, 1]) assert.equal(n('prefill', k), n('decode', k), `rank ${k} pairs`);
    r.proc.kill('SIGTERM');
  }
  await idle(PROD.url, 'producer');
  await idle(CONS.url, 'consumer');
});

test('push (write) mode through the router: the decode leg names the agent of the prefill rank', async () => {
  // Both legs are sent at once; the decode reads from the agent the router names, which
  // must be the one of the rank the prefill went to (each rank has its own).
  const [P, D] = await Promise.all([
    serve(['--dp', '2', '--kv-transfer-config', '{"kv_role":"kv_producer","kv_connector":"mooncake"}']),
    serve(['--dp', '2', '--kv-transfer-config', '{"kv_role":"kv_consumer","kv_connector":"mooncake","transfer_timeout_ms":5000}']),
  ]);
  const r = await router(['--pd-disaggregation', '--prefill', P.url, '--decode', D.url, '--dp-aware',
    '--policy', 'round_robin']);
  await until(async () => (await (await fetch(r.url + '/workers')).json()).workers.length === 4, 'a worker per rank');
  await until(async () => (await fetch(r.url + '/health')).status === 200, 'router healthy');
  const agents = (await (await fetch(P.url + '/kv_transfer_info')).json()).dp_ranks;
  const ws = (await (await fetch(r.url + '/workers')).json()).workers.filter((w) => w.role === 'prefill');
  for (const w of ws) assert.equal(w.engine_id, agents[w.dp_rank].engine_id, `prefill rank ${w.dp_rank}'s agent`);
  for (const p of prompts(8)) {
    const res = await post(r.url, { prompt: p, ...GEN });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.choices[0].text, await expected(p));
    assert.equal(res.json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(res.json.kv_transfer_params));
  }
  const pm = await metrics(P.url);
  r.proc.kill('SIGTERM');
  await idle(P.url, 'push producer');
  await idle(D.url, 'push consumer');
  for (const x of [P, D]) x.proc.kill('SIGTERM');
});

test('one rank stopped: /health is 503 naming it, requests for it are 503, the other rank still serves', async () => {
  const s = await serve(['--dp', '2', '--enable-debug-endpoints', '--debug-step-delay-ms', '5']);
  assert.equal((await post(s.url, { prompt: [1, 5], max_tokens: 2, data_parallel_rank: 1 })).status, 200);
  // stopped in the middle of a request, its CPU marked busy on the board
  const cut = post(s.url, { prompt: [1, 5], max_tokens: 100, ignore_eos: true, data_parallel_rank: 1 });
  await new Promise((ok) => setTimeout(ok, 150));
  assert.equal((await fetch(s.url + '/debug/stop_engine?rank=1', { method: 'POST' })).status, 200);
  await cut;
  await until(async () => (await fetch(s.url + '/health')).status === 503, '/health 503');
  const h = await (await fetch(s.url + '/health')).json();
  assert.match(h.reason, /data-parallel rank 1: the engine loop has stopped/);
  const q = await post(s.url, { prompt: [1, 5], max_tokens: 2, data_parallel_rank: 1 });
  assert.equal(q.status, 503, q.text);
  assert.match(q.json.error.message, /rank 1 has stopped/);
  for (const body of [{ data_parallel_rank: 0 }, {}]) { // rank 0, named or picked
    const r = await post(s.url, { prompt: [1, 5], ...GEN, ...body });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.choices[0].text, await expected([1, 5]));
  }
  // The stopped rank gave its CPU back to the board: rank 0 still borrows it.
  if (os.availableParallelism() >= 2) {
    const before = borrowed(await metrics(s.url));
    assert.equal((await post(s.url, { prompt: [1, 5], max_tokens: 60, ignore_eos: true, data_parallel_rank: 0 })).status, 200);
    assert.ok(borrowed(await metrics(s.url)) > before, 'rank 0 no longer borrows the stopped rank\'s CPU');
  }
  // /health names each rank's state, and a --dp-aware router keeps rank 0 (its worker
  // healthy) while rank 1's is not.
  assert.deepEqual((await (await fetch(s.url + '/health')).json()).rank_status, ['ok', 'stopped']);
  const r = await router(['--worker', s.url, '--dp-aware']);
  const ranks = async () => Object.fromEntries((await (await fetch(r.url + '/workers')).json()).workers
    .map((w) => [w.dp_rank, w.healthy]));
  await until(async () => { const h = await ranks(); return h[0] === true && h[1] === false; },
    'rank 0 healthy, rank 1 not');
  const viaRouter = await post(r.url, { prompt: [1, 5], ...GEN });
  assert.equal(viaRouter.status, 200, viaRouter.text);
  assert.equal(viaRouter.json.choices[0].text, await expected([1, 5]));
  r.proc.kill('SIGTERM');
  s.proc.kill('SIGTERM');
});

test('every server shuts down cleanly', async () => {
  for (const s of [ONE, DP, PROD, CONS]) {
    const code = await new Promise((ok) => { s.proc.on('exit', (c, sig) => ok(sig || c)); s.proc.kill('SIGTERM'); });
    assert.equal(code, 0, `${s.url}: ${s.stderr().slice(-500)}`);
  }
});
