// Mixture-of-experts models served by data-parallel ranks, with and without expert
// parallelism (`tandem serve --data-parallel-size 2 --enable-dp-attention
// --enable-expert-parallel`), real processes over loopback. Greedy output is identical
// with one rank, two ranks each holding every expert, and two ranks splitting the experts
// (every MoE layer then exchanges rows between the ranks); aggregated and through
// prefill/decode for every (prefill rank, decode rank) pair. The expert exchange's memory
// is apart from the KV pools (same KV blocks with and without it, and a full KV pool does
// not stop the exchange), and a stopped rank stops the group with a clear reason.
// Started by tests/integration/test_ep.sh with TD_BIN and TD_MOE_MODELS (comma list).
import { test, after } from 'node:test';
import { metrics, until, startTandem, postJson, tokenPrompts, refText } from './lib.mjs';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';

const BIN = process.env.TD_BIN;
const MODELS = (process.env.TD_MOE_MODELS || '').split(',').filter(Boolean);
assert.ok(BIN && MODELS.length, 'TD_BIN and TD_MOE_MODELS must be set');

const procs = new Set();
after(() => { for (const p of procs) p.kill('SIGKILL'); });

const start = (args) => startTandem(BIN, args, procs);

const serve = (model, extra) => start(['serve', '--model', model, '--threads', '2', '--host', '127.0.0.1',
  '--server-port', '0', '--log-level', 'warn', ...extra]);
const EP = ['--dp', '2', '--enable-dp-attention', '--enable-expert-parallel'];

const post = (base, body) => postJson(base, '/v1/completions', body);

async function idle(base, what) {
  await until(async () => {
    const m = await metrics(base);
    return m.tandem_kv_blocks_used === 0 && m.tandem_num_requests_running === 0;
  }, `${what}: idle with every KV block back`);
}

const GEN = { max_tokens: 12, temperature: 0, ignore_eos: true };

const prompts = (n) => tokenPrompts(n, [1, 4, 16, 17, 40, 90], 31);

for (const model of MODELS) {
  const name = model.split('/').at(-1);
  let ONE, DP, EPS, PROD, CONS;
  const expected = refText(() => ONE.url, GEN);

  test(`${name}: start one rank, two ranks, two ranks with expert parallelism, and a producer and consumer with it`, async () => {
    [ONE, DP, EPS, PROD, CONS] = await Promise.all([
      serve(model, []),
      serve(model, ['--dp', '2']),
      serve(model, EP),
      serve(model, [...EP, '--kv-transfer-config', '{"kv_role":"kv_producer"}']),
      serve(model, [...EP, '--kv-transfer-config', '{"kv_role":"kv_consumer","transfer_timeout_ms":5000}']),
    ]);
  });

  test(`${name}: the same greedy output with 1 rank, 2 ranks, and 2 ranks splitting the experts, on every rank`, async () => {
    const ps = prompts(12);
    for (const p of ps) {
      const w = await expected(p);
      for (const [srv, label] of [[DP, 'dp 2'], [EPS, 'dp 2 + ep']]) {
        for (const rank of [0, 1]) {
          const r = await post(srv.url, { prompt: p, ...GEN, data_parallel_rank: rank });
          assert.equal(r.status, 200, r.text);
          assert.equal(r.json.choices[0].text, w, `${label}, rank ${rank}, ${p.length} tokens`);
        }
      }
    }
    // concurrently: both ranks busy at once, rows of both in every exchange
    const res = await Promise.all(ps.map((p, i) => post(EPS.url, { prompt: p, ...GEN, data_parallel_rank: i % 2 })));
    for (let i = 0; i < ps.length; i++) assert.equal(res[i].json.choices[0].text, await expected(ps[i]), `concurrent ${i}`);
    await idle(EPS.url, 'expert-parallel server');
  });

  test(`${name}: prefill/decode with expert parallelism on both sides, every rank pair`, async () => {
    const ps = prompts(6);
    for (const pr of [0, 1]) {
      for (const dr of [0, 1]) {
        for (const p of ps) {
          const a = await post(PROD.url, { prompt: p, max_tokens: 1, temperature: 0, data_parallel_rank: pr,
            kv_transfer_params: { do_remote_decode: true, do_remote_prefill: false } });
          assert.equal(a.status, 200, a.text);
          assert.equal(a.json.kv_transfer_params.dp_rank, pr);
          const b = await post(CONS.url, { prompt: p, ...GEN, data_parallel_rank: dr, kv_transfer_params: a.json.kv_transfer_params });
          assert.equal(b.status, 200, b.text);
          assert.equal(b.json.choices[0].text, await expected(p), `prefill rank ${pr}, decode rank ${dr}`);
          assert.equal(b.json.kv_transfer_params.kv_load, 'transferred');
        }
      }
    }
    await idle(PROD.url, 'producer');
    await idle(CONS.url, 'consumer');
  });

  test(`${name}: the exchange memory is apart from the KV pools`, async () => {
    const [d, e] = [await metrics(DP.url), await metrics(EPS.url)];
    assert.equal(e.tandem_kv_blocks_total, d.tandem_kv_blocks_total, 'the same KV blocks with and without expert parallelism');
    assert.ok(e.tandem_ep_exchange_bytes > 0, 'the exchange buffers are reported');
    assert.equal(d.tandem_ep_exchange_bytes ?? 0, 0);
  });
}

test('an expert with more rows than a step holds runs them in several passes, with the same output', async () => {
  // Two experts, both used by every row, and steps of 16 tokens: with both ranks prefilling
  // at once, each expert gets up to 32 rows a layer, twice what its exchange buffers hold.
  const model = process.env.TD_MOE_ALL_EXPERTS;
  const flags = ['--max-num-batched-tokens', '16'];
  const [ref, srv] = await Promise.all([serve(model, flags), serve(model, [...EP, ...flags])]);
  const ps = prompts(8).map((p) => p.concat(Array(60).fill(11)).slice(0, 60));
  const res = await Promise.all(ps.map((p, i) => post(srv.url, { prompt: p, ...GEN, data_parallel_rank: i % 2 })));
  for (let i = 0; i < ps.length; i++) {
    assert.equal(res[i].status, 200, res[i].text);
    const w = await post(ref.url, { prompt: ps[i], ...GEN });
    assert.equal(res[i].json.choices[0].text, w.json.choices[0].text, `request ${i}`);
  }
  for (const x of [ref, srv]) x.proc.kill('SIGTERM');
});

test('a full KV pool does not stop the exchange, and the exchange does not take KV blocks', async () => {
  // A small KV pool per rank (about 24 blocks of 16 tokens): ten 102-token requests on rank
  // 0 need 70 blocks, so they wait and get preempted, while rank 1's requests and the
  // exchange of every MoE layer go on.
  const model = MODELS[0];
  const small = ['--kv-cache-memory', '200K', '--max-model-len', '128'];
  const [ref, srv] = await Promise.all([serve(model, small), serve(model, [...EP, ...small])]);
  const ps = prompts(14).map((p) => p.concat(Array(90).fill(7)).slice(0, 90));
  const res = await Promise.all(ps.map((p, i) => post(srv.url, { prompt: p, ...GEN, data_parallel_rank: i < 10 ? 0 : 1 })));
  for (let i = 0; i < ps.length; i++) {
    assert.equal(res[i].status, 200, res[i].text);
    const w = await post(ref.url, { prompt: ps[i], ...GEN });
    assert.equal(res[i].json.choices[0].text, w.json.choices[0].text, `request ${i}`);
  }
  const [mr, ms] = [await metrics(ref.url), await metrics(srv.url)];
  assert.equal(ms.tandem_kv_blocks_total, 2 * mr.tandem_kv_blocks_total, 'each rank has the KV pool it would have alone');
  await idle(srv.url, 'small pool');
  for (const x of [ref, srv]) x.proc.kill('SIGTERM');
});

test('a stopped rank stops the group: /health names it, requests get a clear 503', async () => {
  const s = await serve(MODELS[0], [...EP, '--enable-debug-endpoints']);
  assert.equal((await post(s.url, { prompt: [1, 5], ...GEN, data_parallel_rank: 0 })).status, 200);
  assert.equal((await fetch(s.url + '/debug/stop_engine?rank=1', { method: 'POST' })).status, 200);
  await until(async () => {
    const h = await (await fetch(s.url + '/health')).json();
    return /rank 0: the engine loop has stopped: expert-parallel rank 1 stopped/.test(h.reason || '');
  }, 'rank 0 stopped with the group');
  const r = await post(s.url, { prompt: [1, 5], ...GEN, data_parallel_rank: 0 });
  assert.equal(r.status, 503, r.text);
  assert.match(r.json.error.message, /expert-parallel rank 1 stopped/);
  s.proc.kill('SIGTERM');
});

test('bad combinations are start-up errors', async () => {
  const run = (model, args) => new Promise((ok) => {
    const p = spawn(BIN, ['serve', '--model', model, '--threads', '1', '--server-port', '0', ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
    let err = '';
    p.stderr.on('data', (d) => { err += d; });
    p.on('exit', (code) => ok({ code, err }));
  });
  let r = await run(MODELS[0], ['--enable-expert-parallel']);
  assert.equal(r.code, 2, r.err);
  assert.match(r.err, /needs --data-parallel-size 2 or more/);
  r = await run(process.env.TD_DENSE_MODEL, ['--dp', '2', '--enable-expert-parallel']);
  assert.equal(r.code, 2, r.err);
  assert.match(r.err, /expert parallelism needs a mixture-of-experts model/);
});

test('every server shuts down cleanly', async () => {
  for (const p of procs) {
    const code = await new Promise((ok) => { p.on('exit', (c, sig) => ok(sig || c)); p.kill('SIGTERM'); });
    assert.equal(code, 0);
  }
});
