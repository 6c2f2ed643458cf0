// Prefill/decode disaggregation with real processes: `tandem serve` as kv_producer and
// kv_consumer, talking kvx over loopback, driven the way a router drives them (prefill
// with do_remote_decode and max_tokens 1, then decode with the producer's
// kv_transfer_params). Started by tests/integration/test_pd.sh with TD_BIN and TD_MODEL.
//
// The core invariant: greedy output through producer -> consumer equals one aggregated
// engine's, token for token. Then every failure: producer killed mid-transfer, consumer
// gone after the producer answered, connection cut, corrupted bytes, mismatched layouts,
// a wrong auth token, a guessed transfer id. Each request ends (recomputed, or a clear
// error under kv_load_failure_policy fail) and no KV block leaks on either side. The main
// producer and consumer lend each other their CPUs while idle, as under tandem up.
// No test asserts on timing: deadlines only bound waits for state that must arrive.
import { test, after } from 'node:test';
import { metrics, until, freePort } from './lib.mjs';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import crypto from 'node:crypto';

const BIN = process.env.TD_BIN;
const MODEL = process.env.TD_MODEL;
assert.ok(BIN && MODEL, 'TD_BIN and TD_MODEL must be set');

const procs = new Set();
after(() => { for (const p of procs) p.kill('SIGKILL'); });

// Start `tandem serve`; resolves to {url, port, agentPort, proc, stderr()}.
function serve(args, env = {}) {
  return new Promise((resolve, reject) => {
    const p = spawn(BIN, ['serve', '--model', MODEL, '--threads', '1', '--host', '127.0.0.1',
      '--server-port', '0', ...args], { env: { ...process.env, ...env }, stdio: ['ignore', 'ignore', 'pipe'] });
    procs.add(p);
    let err = '';
    let agentPort = null;
    p.stderr.on('data', (d) => {
      err += d;
      const a = err.match(/kv transfer agent on [^:]+:(\d+)/);
      if (a) agentPort = Number(a[1]);
      const m = err.match(/listening on [^\n]*:(\d+)\n/);
      if (m && !p.started) {
        p.started = true;
        resolve({ url: `http://127.0.0.1:${m[1]}`, agentPort, proc: p, stderr: () => err });
      }
    });
    p.on('exit', (code) => { procs.delete(p); if (!p.started) reject(new Error(`serve exited ${code}: ${err}`)); });
  });
}

async function post(base, body) {
  const res = await fetch(base + '/v1/completions', {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, json, text };
}

async function noLeaks(base, what) {
  let m = {};
  await until(async () => {
    m = await metrics(base);
    return m.tandem_kv_blocks_used === 0 && !(m.tandem_kv_leases_active > 0);
  }, `${what}: KV blocks back to baseline`).catch((e) => {
    throw new Error(`${e.message} (blocks used ${m.tandem_kv_blocks_used}, leases ${m.tandem_kv_leases_active})`);
  });
}

// A producer's lease counters agree: every lease (a push from its opening) is active,
// released or expired.
function leaseBooks(m, total) {
  if (total !== undefined) assert.equal(m.tandem_kv_leases_total, total);
  assert.equal(m.tandem_kv_leases_total,
    m.tandem_kv_leases_active + m.tandem_kv_leases_released_total + m.tandem_kv_leases_expired_total,
    `leases: ${JSON.stringify(m)}`.slice(0, 400));
}

const GEN = { max_tokens: 12, temperature: 0, ignore_eos: true };

// Prompts as token ids (BOS first): 1 token, multiples of the block size (16), and
// lengths past several blocks; stories260K's context is 128 tokens.
function prompts() {
  const lens = [1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 64, 80, 96, 100, 110];
  const out = [];
  for (let i = 0; i < 40; i++) {
    const n = lens[i % lens.length];
    const ids = [1];
    let s = 1000 + i * 7919;
    for (let k = 1; k < n; k++) { s = (s * 1103515245 + 12345) % 2147483648; ids.push(3 + (s % 500)); }
    out.push(ids);
  }
  return out;
}

async function prefill(prod, prompt) {
  const r = await post(prod, { prompt, max_tokens: 1, temperature: 0, stream: false,
    kv_transfer_params: { do_remote_decode: true, do_remote_prefill: false } });
  assert.equal(r.status, 200, r.text);
  const kv = r.json.kv_transfer_params;
  assert.equal(kv.do_remote_prefill, true, r.text);
  return kv;
}

async function decode(cons, prompt, kv, extra = {}) {
  return post(cons, { prompt, ...GEN, ...extra, kv_transfer_params: kv });
}

async function pool(items, width, fn) {
  const res = new Array(items.length);
  let next = 0;
  await Promise.all(Array.from({ length: width }, async () => {
    while (next < items.length) { const i = next++; res[i] = await fn(items[i], i); }
  }));
  return res;
}

let AGG, PROD, CONS, CONS_FAIL;
const want = new Map();
async function expected(prompt) {
  const key = prompt.join(',');
  if (!want.has(key)) {
    const r = await post(AGG.url, { prompt, ...GEN });
    assert.equal(r.status, 200, r.text);
    want.set(key, r.json.choices[0].text);
  }
  return want.get(key);
}

// With two CPUs or more, the producer and the consumer own one each and lend it to the
// other while idle (--cpus, --cpu-board, as tandem up runs them), so every test below
// also runs with CPUs changing hands between the parallel runs of a step.
function lendFlags() {
  const list = execFileSync('taskset', ['-pc', String(process.pid)]).toString().split(': ')[1].trim();
  const cpus = list.split(',').flatMap((r) => {
    const [a, b] = r.split('-').map(Number);
    return Array.from({ length: (b ?? a) - a + 1 }, (_, i) => a + i);
  });
  if (cpus.length < 2) return [[], []];
  const board = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'td-pd-')), 'cpu-board');
  return [0, 1].map((i) => ['--cpus', String(cpus[i]), '--cpu-board', board]);
}
const LEND = lendFlags();

test('start the servers', async () => {
  [AGG, PROD, CONS, CONS_FAIL] = await Promise.all([
    serve([]),
    serve(['--kv-transfer-config', '{"kv_role":"kv_producer","kv_connector":"moriio"}', ...LEND[0]]),
    serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","transfer_timeout_ms":5000}', ...LEND[1]]),
    serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","kv_load_failure_policy":"fail","transfer_timeout_ms":5000}']),
  ]);
  assert.ok(PROD.agentPort > 0);
});

test('equivalence: 40 prompts through producer -> consumer, 16 at a time', async () => {
  const ps = prompts();
  for (const p of ps) await expected(p);
  const before = await metrics(CONS.url);
  const res = await pool(ps, 16, async (p) => {
    const kv = await prefill(PROD.url, p);
    assert.equal(kv.num_prompt_tokens, p.length);
    assert.equal(kv.remote_block_ids.length, Math.ceil(p.length / 16));
    const r = await decode(CONS.url, p, kv);
    assert.equal(r.status, 200, r.text);
    return r.json;
  });
  let transferred = 0;
  for (let i = 0; i < ps.length; i++) {
    assert.equal(res[i].choices[0].text, await expected(ps[i]), `prompt ${i} (${ps[i].length} tokens)`);
    const kv = res[i].kv_transfer_params;
    assert.equal(kv.do_remote_prefill, true);
    assert.equal(kv.kv_load, 'transferred', JSON.stringify(kv));
    for (const f of ['producer_queue_ms', 'producer_compute_ms', 'transfer_ms', 'consumer_queue_ms', 'first_decode_step_ms'])
      assert.equal(typeof kv.timing[f], 'number', f);
    transferred += kv.transferred_blocks;
  }
  const m = await metrics(CONS.url);
  assert.equal(m.tandem_kv_transfers_total - before.tandem_kv_transfers_total, 40);
  assert.equal(m.tandem_kv_transfer_blocks_total - before.tandem_kv_transfer_blocks_total, transferred);
  await noLeaks(PROD.url, 'producer');
  await noLeaks(CONS.url, 'consumer');
  const pm = await metrics(PROD.url);
  assert.equal(pm.tandem_kv_leases_expired_total, 0);
  // The producer's first prefills found the consumer idle, waiting for KV: they borrowed.
  if (LEND[0].length) assert.ok(pm.tandem_cpu_borrowed_runs_total > 0, 'the producer never borrowed');
});

// The same invariant over the ucx transport (one-sided gets), on UCX's tcp and
// shared-memory transports; the producer's agent serves every protocol.
for (const tls of ['tcp', 'sm']) {
  test(`equivalence over ucx (UCX_TLS=${tls}): 40 prompts, 16 at a time`, async (t) => {
    const cons = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","protocol":"ucx","transfer_timeout_ms":5000}'],
      { UCX_TLS: tls }).catch((e) => e);
    if (cons instanceof Error && /not available in this build/.test(cons.message)) {
      t.skip('this build has no ucx transport (libucx-dev missing)');
      return;
    }
    assert.ok(!(cons instanceof Error), String(cons));
    const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer"}'], { UCX_TLS: tls });
    const ps = prompts();
    const res = await pool(ps, 16, async (p) => (await decode(cons.url, p, await prefill(prod.url, p))).json);
    for (let i = 0; i < ps.length; i++) {
      assert.equal(res[i].kv_transfer_params.kv_load, 'transferred', JSON.stringify(res[i].kv_transfer_params));
      assert.equal(res[i].choices[0].text, await expected(ps[i]), `prompt ${i}`);
    }
    await noLeaks(prod.url, 'ucx producer');
    await noLeaks(cons.url, 'ucx consumer');
    for (const x of [prod, cons]) {
      const code = await new Promise((r) => { x.proc.on('exit', (c) => r(c)); x.proc.kill('SIGTERM'); });
      assert.equal(code, 0, x.stderr());
    }
  });
}

// Push (transfer_mode write), driven as a router drives it: both instances at once, with
// one transfer id the router draws. The producer announces each layer's blocks as its
// prefill computes them and the consumer reads them at once; the first token and the
// producer's timing come with the last announcement.
async function info(base) {
  return (await fetch(base + '/kv_transfer_info')).json();
}

async function pushPair(prod, pinfo, consUrl, prompt, extra = {}, tid = crypto.randomBytes(16).toString('hex')) {
  const [p, d] = await Promise.all([
    post(prod, { prompt, max_tokens: 1, temperature: 0,
      kv_transfer_params: { do_remote_decode: true, transfer_mode: 'write', transfer_id: tid } }),
    post(consUrl, { prompt, ...GEN, ...extra,
      kv_transfer_params: { do_remote_prefill: true, transfer_mode: 'write', transfer_id: tid,
        remote_engine_id: pinfo.engine_id, remote_host: pinfo.kv_host,
        remote_handshake_port: pinfo.handshake_port } }),
  ]);
  return { p, d };
}

for (const proto of ['tcp', 'shm', 'ucx']) {
  test(`equivalence in write mode over ${proto}: 40 prompts, 16 at a time, both dispatched at once`, async (t) => {
    const env = proto === 'ucx' ? { UCX_TLS: 'sm' } : {};
    const cons = await serve(['--kv-transfer-config',
      `{"kv_role":"kv_consumer","protocol":"${proto}","transfer_mode":"write","transfer_timeout_ms":5000}`], env).catch((e) => e);
    if (cons instanceof Error && /not available in this build/.test(cons.message)) {
      t.skip(`this build has no ${proto} transport`);
      return;
    }
    assert.ok(!(cons instanceof Error), String(cons));
    const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","protocol":"shm","kv_connector":"mooncake"}'], env);
    const pinfo = await info(prod.url);
    assert.equal(pinfo.transfer_mode, 'write'); /* mooncake means push */
    assert.match(pinfo.engine_id, /^[0-9a-f]{32}$/);
    const ps = prompts();
    const res = await pool(ps, 16, async (p) => {
      const { p: pr, d } = await pushPair(prod.url, pinfo, cons.url, p);
      assert.equal(pr.status, 200, pr.text);
      assert.equal(pr.json.kv_transfer_params.transfer_mode, 'write', pr.text);
      assert.equal(d.status, 200, d.text);
      return d.json;
    });
    for (let i = 0; i < ps.length; i++) {
      const kv = res[i].kv_transfer_params;
      assert.equal(kv.kv_load, 'transferred', JSON.stringify(kv));
      assert.equal(kv.transfer_mode, 'write');
      assert.ok(kv.timing.producer_compute_ms > 0, JSON.stringify(kv.timing));
      assert.equal(res[i].choices[0].text, await expected(ps[i]), `prompt ${i} (${ps[i].length} tokens)`);
    }
    const cm = await metrics(cons.url), pm = await metrics(prod.url);
    assert.equal(cm.tandem_kv_push_transfers_total, 40);
    assert.equal(pm.tandem_kv_pushes_opened_total, 40);
    assert.equal(pm.tandem_kv_pushes_claimed_total, 40);
    leaseBooks(pm);
    // A consumer prefix-cache hit: only the tail moves, in write mode too.
    const p = ps[13]; /* 100 tokens: 6 full blocks cached here now */
    const before = await metrics(cons.url);
    const { d } = await pushPair(prod.url, pinfo, cons.url, p);
    const kv = d.json.kv_transfer_params;
    assert.equal(kv.kv_load, 'transferred', JSON.stringify(kv));
    assert.equal(kv.cached_blocks, 6);
    assert.equal(kv.transferred_blocks, 1);
    assert.equal(d.json.choices[0].text, await expected(p));
    const after = await metrics(cons.url);
    assert.equal(after.tandem_kv_transfer_blocks_total - before.tandem_kv_transfer_blocks_total, 1);
    await noLeaks(prod.url, `${proto} push producer`);
    await noLeaks(cons.url, `${proto} push consumer`);
    for (const x of [prod, cons]) {
      const code = await new Promise((r) => { x.proc.on('exit', (c) => r(c)); x.proc.kill('SIGTERM'); });
      assert.equal(code, 0, x.stderr());
    }
  });
}

test('a write-mode decode request whose client leaves ends at once, not at the push timeout', async () => {
  // The prefill never comes (the router cancelled it with the client): the consumer must not
  // hold the request and its blocks for transfer_timeout_ms (60 s here).
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","transfer_mode":"write"}']);
  const pinfo = await info(prod.url);
  const cons = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","transfer_timeout_ms":60000}']);
  for (const stream of [false, true]) {
    const ac = new AbortController();
    const t = setTimeout(() => ac.abort(), 300);
    await fetch(`${cons.url}/v1/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, signal: ac.signal,
      body: JSON.stringify({ prompt: prompts()[12], ...GEN, stream, kv_transfer_params: {
        do_remote_prefill: true, transfer_mode: 'write', transfer_id: crypto.randomBytes(16).toString('hex'),
        remote_engine_id: pinfo.engine_id, remote_host: pinfo.kv_host, remote_handshake_port: pinfo.handshake_port } }),
    }).then((r) => r.text()).then(() => assert.fail('the request should have been cut'), (e) => {
      assert.equal(e.name, 'AbortError', String(e));
    });
    clearTimeout(t);
    await until(async () => {
      const m = await metrics(cons.url);
      return m.tandem_num_requests_running === 0 && m.tandem_kv_blocks_used === 0;
    }, `the aborted push request ended (stream ${stream})`, 5000);
  }
  // Both sides still work.
  const p = prompts()[3];
  const { p: pr, d } = await pushPair(prod.url, pinfo, cons.url, p);
  assert.equal(pr.status, 200, pr.text);
  assert.equal(d.json.kv_transfer_params.kv_load, 'transferred', d.text);
  assert.equal(d.json.choices[0].text, await expected(p));
  for (const x of [prod, cons]) { await noLeaks(x.url, 'after the aborted pushes'); x.proc.kill('SIGKILL'); }
});

test('write mode failures: no prefill arrives, the producer dies mid-push, a reused transfer id', async () => {
  // A short lease: a push that no consumer claims (the second prefill below may come after
  // the first one's consumer released the id) is reclaimed when it expires.
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","transfer_mode":"write","lease_ms":1000}']);
  const pinfo = await info(prod.url);
  const cons = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","transfer_timeout_ms":800}']);
  const consFail = await serve(['--kv-transfer-config',
    '{"kv_role":"kv_consumer","transfer_timeout_ms":800,"kv_load_failure_policy":"fail"}']);
  const p = prompts()[12];
  const params = (tid) => ({ do_remote_prefill: true, transfer_mode: 'write', transfer_id: tid,
    remote_engine_id: pinfo.engine_id, remote_host: pinfo.kv_host, remote_handshake_port: pinfo.handshake_port });
  // The router never reached the producer: the consumer gives up after its timeout and
  // recomputes, or fails clearly.
  let r = await post(cons.url, { prompt: p, ...GEN, kv_transfer_params: params(crypto.randomBytes(16).toString('hex')) });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed', r.text);
  assert.match(r.json.kv_transfer_params.kv_load_error, /no prefill with this transfer id/);
  assert.equal(r.json.choices[0].text, await expected(p));
  r = await post(consFail.url, { prompt: p, ...GEN, kv_transfer_params: params(crypto.randomBytes(16).toString('hex')) });
  assert.ok(r.status >= 400 || r.json.choices[0].finish_reason === 'error', r.text);
  assert.match(r.text, /kv transfer failed/);
  // A transfer id that is in use is refused by the producer; the consumer still ends.
  const tid = crypto.randomBytes(16).toString('hex');
  const [a, b, c] = await Promise.all([
    post(prod.url, { prompt: p, max_tokens: 1, temperature: 0, kv_transfer_params: { do_remote_decode: true, transfer_mode: 'write', transfer_id: tid } }),
    post(prod.url, { prompt: p, max_tokens: 1, temperature: 0, kv_transfer_params: { do_remote_decode: true, transfer_mode: 'write', transfer_id: tid } }),
    post(cons.url, { prompt: p, ...GEN, kv_transfer_params: params(tid) }),
  ]);
  assert.equal([a, b].filter((x) => x.status === 200).length >= 1, true);
  assert.equal(c.status, 200, c.text);
  assert.equal(c.json.choices[0].text, await expected(p));
  await noLeaks(prod.url, 'push producer after a reused id');
  // The producer killed while its prefill streams: the decode request still ends, right.
  const long = prompts()[14];
  const pending = post(cons.url, { prompt: long, ...GEN, kv_transfer_params: params(crypto.randomBytes(16).toString('hex')) });
  await new Promise((res) => setTimeout(res, 30));
  prod.proc.kill('SIGKILL');
  r = await pending;
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, await expected(long));
  for (const x of [cons, consFail]) { await noLeaks(x.url, 'push consumer'); x.proc.kill('SIGKILL'); }
});

test('kv_both serves plain requests, and prefills or decodes for a peer', async () => {
  const [b1, b2] = await Promise.all([
    serve(['--kv-transfer-config', '{"kv_role":"kv_both"}']),
    serve(['--kv-transfer-config', '{"kv_role":"kv_both"}']),
  ]);
  const p = prompts()[9];
  const plain = await post(b1.url, { prompt: p, ...GEN });
  assert.equal(plain.status, 200, plain.text);
  assert.equal(plain.json.choices[0].text, await expected(p));
  assert.equal(plain.json.kv_transfer_params, undefined);
  for (const [from, to] of [[b1, b2], [b2, b1]]) {
    const q = prompts()[from === b1 ? 10 : 11];
    const r = await decode(to.url, q, await prefill(from.url, q));
    assert.equal(r.json.kv_transfer_params.kv_load, 'transferred');
    assert.equal(r.json.choices[0].text, await expected(q));
  }
  for (const x of [b1, b2]) { await noLeaks(x.url, 'kv_both'); x.proc.kill('SIGKILL'); }
});

test('equivalence over shm: 40 prompts, 16 at a time; a non-shareable producer is recomputed', async () => {
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","protocol":"shm"}']);
  const cons = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","protocol":"shm","transfer_timeout_ms":5000}']);
  const ps = prompts();
  const res = await pool(ps, 16, async (p) => (await decode(cons.url, p, await prefill(prod.url, p))).json);
  for (let i = 0; i < ps.length; i++) {
    assert.equal(res[i].kv_transfer_params.kv_load, 'transferred', JSON.stringify(res[i].kv_transfer_params));
    assert.equal(res[i].choices[0].text, await expected(ps[i]), `prompt ${i}`);
  }
  // PROD keeps its pool in private memory: an shm consumer cannot map it.
  const p = prompts()[5];
  const r = await decode(cons.url, p, await prefill(PROD.url, p));
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r.json.kv_transfer_params.kv_load_error, /not shareable/);
  assert.equal(r.json.choices[0].text, await expected(p));
  await noLeaks(prod.url, 'shm producer');
  await noLeaks(cons.url, 'shm consumer');
  await noLeaks(PROD.url, 'tcp producer after an shm consumer');
  for (const x of [prod, cons]) {
    const code = await new Promise((res2) => { x.proc.on('exit', (c) => res2(c)); x.proc.kill('SIGTERM'); });
    assert.equal(code, 0, x.stderr());
  }
});

test('a consumer prefix-cache hit transfers only the tail', async () => {
  const p = prompts()[11]; // 80 tokens = 5 blocks
  assert.equal(p.length, 80);
  const extra = [...p.slice(0, 64), 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22];
  // Warm the consumer's prefix cache with a request sharing the first 4 blocks.
  const r0 = await decode(CONS.url, extra, await prefill(PROD.url, extra));
  assert.equal(r0.status, 200, r0.text);
  const before = await metrics(CONS.url);
  const r = await decode(CONS.url, p, await prefill(PROD.url, p));
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, await expected(p));
  const kv = r.json.kv_transfer_params;
  assert.equal(kv.cached_blocks, 4, JSON.stringify(kv));
  assert.equal(kv.transferred_blocks, 1);
  const m = await metrics(CONS.url);
  assert.equal(m.tandem_kv_transfer_blocks_total - before.tandem_kv_transfer_blocks_total, 1);
  assert.equal(r.json.usage.prompt_tokens_details.cached_tokens, 64);
});

test('streaming decode ends with kv_transfer_params', async () => {
  const p = prompts()[5];
  const kv = await prefill(PROD.url, p);
  const res = await fetch(CONS.url + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt: p, ...GEN, stream: true, kv_transfer_params: kv }) });
  const raw = await res.text();
  const events = raw.split('\n\n').filter((e) => e.startsWith('data: {')).map((e) => JSON.parse(e.slice(6)));
  const text = events.map((e) => e.choices?.[0]?.text ?? '').join('');
  assert.equal(text, await expected(p));
  const last = events.filter((e) => e.choices?.[0]?.finish_reason).pop();
  assert.equal(last.kv_transfer_params.kv_load, 'transferred');
});

test('bad kv_transfer_params are a 400 that names the problem', async () => {
  const p = prompts()[4];
  const kv = await prefill(PROD.url, p);
  const cases = [
    [CONS.url, { do_remote_decode: true }, 'not a KV producer'],
    [PROD.url, { ...kv }, 'not a KV consumer'],
    [CONS.url, { ...kv, remote_engine_id: 'xyz' }, 'remote_engine_id'],
    [CONS.url, { ...kv, remote_block_ids: 'a' }, 'remote_block_ids'],
    [CONS.url, { ...kv, remote_block_ids: [-1] }, 'remote_block_ids'],
    [CONS.url, { ...kv, first_token_id: 1e9 }, 'first_token_id'],
    [CONS.url, { ...kv, remote_host: 7 }, 'remote_host'],
    [CONS.url, { ...kv, remote_handshake_port: 70000, remote_port: 70000 }, 'port'],
    [CONS.url, { do_remote_decode: true, do_remote_prefill: true }, 'both'],
  ];
  for (const [url, params, msg] of cases) {
    const r = await post(url, { prompt: p, ...GEN, kv_transfer_params: params });
    assert.equal(r.status, 400, `${msg}: ${r.text}`);
    assert.match(r.json.error.message, new RegExp(msg), r.text);
  }
  const r = await post(PROD.url, { prompt: [p, p], max_tokens: 1, kv_transfer_params: { do_remote_decode: true } });
  assert.equal(r.status, 400);
  assert.match(r.json.error.message, /one prompt/);
  // The consumer's lease was never used: release it so the producer is idle again.
  const ok = await decode(CONS.url, p, kv);
  assert.equal(ok.status, 200, ok.text);
  await noLeaks(PROD.url, 'producer after bad params');
});

test('a prompt that tokenizes differently is recomputed (or refused under fail)', async () => {
  const p = prompts()[7];
  let kv = await prefill(PROD.url, p);
  const r = await decode(CONS.url, p, { ...kv, num_prompt_tokens: p.length + 1 });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, await expected(p));
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r.json.kv_transfer_params.kv_load_error, /tokens/);
  kv = await prefill(PROD.url, p);
  const f = await decode(CONS_FAIL.url, p, { ...kv, block_size: 32 });
  assert.equal(f.status, 400, f.text);
  assert.match(f.json.error.message, /block_size differs: producer 32, consumer 16/);
  // Both leases were released by the consumers although they did not read them.
  await noLeaks(PROD.url, 'producer after mismatches');
});

test('a guessed transfer_id reads nothing; the real lease stays', async () => {
  const p = prompts()[8];
  const kv = await prefill(PROD.url, p);
  const guess = { ...kv, transfer_id: crypto.randomBytes(16).toString('hex') };
  const before = await metrics(PROD.url);
  const r = await decode(CONS.url, p, guess);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r.json.kv_transfer_params.kv_load_error, /not|unknown/i);
  assert.equal(r.json.choices[0].text, await expected(p));
  const m = await metrics(PROD.url);
  assert.equal(m.tandem_kv_sent_bytes_total, before.tandem_kv_sent_bytes_total, 'nothing was sent');
  assert.ok(m.tandem_kv_unknown_transfer_total > before.tandem_kv_unknown_transfer_total);
  assert.equal(m.tandem_kv_leases_active, 1, 'the real transfer is still held');
  const ok = await decode(CONS.url, p, kv);
  assert.equal(ok.json.kv_transfer_params.kv_load, 'transferred');
  await noLeaks(PROD.url, 'producer after the guess');
});

test('corrupted bytes fail the checksum: recompute, or a clear error under fail', async () => {
  const [prod, cons, consFail] = await Promise.all([
    serve(['--kv-transfer-config', '{"kv_role":"kv_producer"}']),
    serve(['--enable-debug-endpoints', '--debug-kv-corrupt', '1', '--kv-transfer-config', '{"kv_role":"kv_consumer"}']),
    serve(['--enable-debug-endpoints', '--debug-kv-corrupt', '1', '--kv-transfer-config', '{"kv_role":"kv_consumer","kv_load_failure_policy":"fail"}']),
  ]);
  const p = prompts()[12];
  const r = await decode(cons.url, p, await prefill(prod.url, p));
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r.json.kv_transfer_params.kv_load_error, /checksum/);
  assert.equal(r.json.choices[0].text, await expected(p));
  const f = await decode(consFail.url, p, await prefill(prod.url, p));
  assert.equal(f.status, 500, f.text);
  assert.match(f.json.error.message, /kv transfer failed: .*checksum/);
  const m = await metrics(cons.url);
  assert.equal(m['tandem_kv_transfer_failures_total{reason="checksum"}'], 1);
  for (const s of [prod, cons, consFail]) { await noLeaks(s.url, 'corruption'); s.proc.kill('SIGKILL'); }
});

test('the producer killed mid-transfer: the decode request still ends', async () => {
  for (const policy of ['recompute', 'fail']) {
    const prod = await serve(['--enable-debug-endpoints', '--debug-kv-send-delay-ms', '5000',
      '--kv-transfer-config', '{"kv_role":"kv_producer"}']);
    const cons = policy === 'fail' ? CONS_FAIL : CONS;
    const p = prompts()[13];
    const kv = await prefill(prod.url, p);
    const pending = decode(cons.url, p, kv);
    // The producer holds each read for 5 s before sending its bytes; the read starts
    // within milliseconds of the decode request, so after 500 ms it is in flight.
    await new Promise((r) => setTimeout(r, 500));
    prod.proc.kill('SIGKILL');
    const r = await pending;
    if (policy === 'recompute') {
      assert.equal(r.status, 200, r.text);
      assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
      assert.equal(r.json.choices[0].text, await expected(p));
    } else {
      assert.equal(r.status, 500, r.text);
      assert.match(r.json.error.message, /kv transfer failed/);
    }
    await noLeaks(cons.url, `consumer (${policy}) after the producer died`);
  }
  // And a producer that is gone before the decode starts: nothing listens any more.
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer"}']);
  const p = prompts()[3];
  const kv = await prefill(prod.url, p);
  prod.proc.kill('SIGKILL');
  await new Promise((r) => prod.proc.on('exit', r));
  const r = await decode(CONS.url, p, kv);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
  assert.equal(r.json.choices[0].text, await expected(p));
});

test('a consumer whose engine loop stops mid-load answers the request when the load ends', async () => {
  // The producer holds the read for 1.5 s; the consumer's loop is stopped meanwhile. The
  // aborted request cannot end before its blocks stop being written, but it must end then.
  const prod = await serve(['--enable-debug-endpoints', '--debug-kv-send-delay-ms', '1500',
    '--kv-transfer-config', '{"kv_role":"kv_producer"}']);
  const cons = await serve(['--enable-debug-endpoints', '--kv-transfer-config', '{"kv_role":"kv_consumer"}']);
  const p = prompts()[13];
  const kv = await prefill(prod.url, p);
  const pending = decode(cons.url, p, kv);
  await new Promise((r) => setTimeout(r, 300));
  assert.equal((await fetch(cons.url + '/debug/stop_engine', { method: 'POST' })).status, 200);
  const r = await pending;
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].finish_reason, 'abort', r.text);
  await noLeaks(cons.url, 'the stopped consumer');
  assert.equal((await fetch(cons.url + '/health')).status, 503);
  for (const x of [prod, cons]) x.proc.kill('SIGKILL');
});

test('the consumer gone after the producer answered: the lease expires, the blocks return', async () => {
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","lease_ms":2000}']);
  const cons = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer"}']);
  const p = prompts()[10];
  await prefill(prod.url, p); // the consumer would read this next...
  cons.proc.kill('SIGKILL');  // ...but dies first
  let m = await metrics(prod.url);
  assert.ok(m.tandem_kv_blocks_used > 0, 'the blocks are held for the consumer');
  await noLeaks(prod.url, 'producer after its consumer died');
  m = await metrics(prod.url);
  assert.equal(m.tandem_kv_leases_expired_total, 1);
  prod.proc.kill('SIGKILL');
});

test('a client that leaves during the producer\'s last prefill step leaves no lease behind', async () => {
  // Each step takes 600 ms here: the client hangs up 200 ms into the step that ends the
  // prefill, so its abort arrives after the step has put the blocks under a lease whose
  // transfer id nobody will learn. The producer must end that lease at once.
  const prod = await serve(['--enable-debug-endpoints', '--debug-step-delay-ms', '600',
    '--kv-transfer-config', '{"kv_role":"kv_producer","lease_ms":60000}']);
  // Read mode, then stream, then write mode (a push: its transfer id is the router's, and
  // the router releases a push that no consumer read, as this test does).
  const modes = [{ stream: false }, { stream: true },
    { stream: false, kv: { transfer_mode: 'write', transfer_id: crypto.randomBytes(16).toString('hex') } }];
  for (const [i, mode] of modes.entries()) {
    const ac = new AbortController();
    const t = setTimeout(() => ac.abort(), 200);
    await fetch(`${prod.url}/v1/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, signal: ac.signal,
      body: JSON.stringify({ prompt: prompts()[7], max_tokens: 1, temperature: 0, stream: mode.stream,
        kv_transfer_params: { do_remote_decode: true, ...mode.kv } }),
    }).then((r) => r.text()).then(() => assert.fail('the request should have been cut'), (e) => {
      assert.equal(e.name, 'AbortError', String(e));
    });
    clearTimeout(t);
    if (mode.kv) {
      const r = await fetch(`${prod.url}/kv_release`, { method: 'POST',
        headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ transfer_id: mode.kv.transfer_id }) });
      assert.equal(r.status, 200, await r.text());
    }
    // The step ends 400 ms later; well within the 60 s lease, its lease is ended...
    await until(async () => (await metrics(prod.url)).tandem_kv_leases_released_total === i + 1,
      `the orphaned lease ended (${JSON.stringify(mode)})`);
    // ...and the blocks are back.
    await noLeaks(prod.url, `producer after a client left mid-step (${JSON.stringify(mode)})`);
  }
  const m = await metrics(prod.url);
  assert.equal(m.tandem_kv_leases_expired_total, 0);
  leaseBooks(m, 3);
  prod.proc.kill('SIGKILL');
});

test('a request queued longer than the lease keeps it alive with heartbeats', async () => {
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","lease_ms":300}']);
  // One sequence at a time, 40 ms per step: the second request waits about 1.2 s.
  const cons = await serve(['--max-num-seqs', '1', '--enable-debug-endpoints', '--debug-step-delay-ms', '40',
    '--kv-transfer-config', '{"kv_role":"kv_consumer"}']);
  const busy = post(cons.url, { prompt: [1, 2, 3], max_tokens: 30, ignore_eos: true });
  const p = prompts()[9];
  const r = await decode(cons.url, p, await prefill(prod.url, p));
  assert.equal((await busy).status, 200);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(r.json.kv_transfer_params));
  assert.equal(r.json.choices[0].text, await expected(p));
  const pm = await metrics(prod.url), cm = await metrics(cons.url);
  assert.equal(pm.tandem_kv_leases_expired_total, 0);
  assert.ok(cm.tandem_kv_heartbeats_total >= 2, `heartbeats: ${cm.tandem_kv_heartbeats_total}`);
  for (const s of [prod, cons]) { await noLeaks(s.url, 'heartbeats'); s.proc.kill('SIGKILL'); }
});

test('reads queued in the consumer\'s transfer engine keep their leases alive too', async () => {
  // One worker and one connection, and a producer that takes 800 ms a read: the fourth
  // read starts about 2.4 s after it was queued, past the 1.2 s lease, which only the
  // consumer's heartbeats (every 400 ms, on a connection of their own) keep alive.
  const prod = await serve(['--enable-debug-endpoints', '--debug-kv-send-delay-ms', '800',
    '--kv-transfer-config', '{"kv_role":"kv_producer","lease_ms":1200}']);
  const cons = await serve(['--kv-transfer-config',
    '{"kv_role":"kv_consumer","num_worker_threads":1,"qp_per_transfer":1,"transfer_timeout_ms":20000}']);
  const ps = prompts().slice(20, 24);
  const kvs = [];
  for (const p of ps) kvs.push(await prefill(prod.url, p));
  const rs = await Promise.all(ps.map((p, i) => decode(cons.url, p, kvs[i])));
  for (let i = 0; i < ps.length; i++) {
    assert.equal(rs[i].status, 200, rs[i].text);
    assert.equal(rs[i].json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(rs[i].json.kv_transfer_params));
    assert.equal(rs[i].json.choices[0].text, await expected(ps[i]));
  }
  assert.equal((await metrics(prod.url)).tandem_kv_leases_expired_total, 0);
  for (const s of [prod, cons]) { await noLeaks(s.url, 'queued reads'); s.proc.kill('SIGKILL'); }
});

test('a ucx read that runs out of time does not take its producer down (UCX_TLS=tcp)', async (t) => {
  // 35 MB of KV (llama-134m shape, 961 tokens) against a 30 ms deadline: the consumer gives
  // up with gets in flight. It lets them finish before it closes its endpoint; closing
  // under them made UCX abort the producer's process as it answered them.
  const big = ['--load-format', 'dummy', '--model', 'llama-134m', '--kv-cache-memory', '256M'];
  const prod = await serve([...big, '--kv-transfer-config', '{"kv_role":"kv_producer","protocol":"ucx"}'],
    { UCX_TLS: 'tcp' }).catch((e) => e);
  if (prod instanceof Error && /not available in this build/.test(prod.message)) {
    t.skip('this build has no ucx transport (libucx-dev missing)');
    return;
  }
  assert.ok(!(prod instanceof Error), String(prod));
  const cons = await serve([...big, '--kv-transfer-config',
    '{"kv_role":"kv_consumer","protocol":"ucx","transfer_timeout_ms":30}'], { UCX_TLS: 'tcp' });
  const prompt = Array.from({ length: 961 }, (_, i) => (i ? 3 + (i * 7) % 500 : 1));
  for (let k = 0; k < 3; k++) {
    const r = await post(cons.url, { prompt, max_tokens: 2, temperature: 0,
      kv_transfer_params: await prefill(prod.url, prompt) });
    assert.equal(r.status, 200, r.text); /* transferred, or recomputed after the deadline */
    const h = await fetch(prod.url + '/health').catch((e) => e);
    assert.ok(!(h instanceof Error) && h.status === 200, `the producer is gone: ${prod.stderr().slice(-400)}`);
  }
  for (const s of [prod, cons]) { await noLeaks(s.url, 'ucx deadline'); s.proc.kill('SIGKILL'); }
});

test('a restarted producer (same port, new engine id) gets a new session', async () => {
  const free = await freePort();
  const cfg = `{"kv_role":"kv_producer","handshake_port":${free}}`;
  const p = prompts()[6];
  let prod = await serve(['--kv-transfer-config', cfg]);
  const kv1 = await prefill(prod.url, p);
  const r1 = await decode(CONS.url, p, kv1);
  assert.equal(r1.json.kv_transfer_params.kv_load, 'transferred');
  prod.proc.kill('SIGKILL');
  await new Promise((r) => prod.proc.on('exit', r));
  prod = await serve(['--kv-transfer-config', cfg]);
  const kv2 = await prefill(prod.url, p);
  assert.equal(kv2.remote_handshake_port, free);
  assert.notEqual(kv2.remote_engine_id, kv1.remote_engine_id);
  const r2 = await decode(CONS.url, p, kv2);
  assert.equal(r2.json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(r2.json.kv_transfer_params));
  assert.equal(r2.json.choices[0].text, await expected(p));
  // The old incarnation's parameters now name an engine that is gone: recomputed.
  const r3 = await decode(CONS.url, p, kv1);
  assert.equal(r3.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r3.json.kv_transfer_params.kv_load_error, /restart|engine/);
  assert.equal(r3.json.choices[0].text, await expected(p));
  await noLeaks(prod.url, 'restarted producer');
  prod.proc.kill('SIGKILL');
});

test('transfer sessions authenticate: the right token transfers, a wrong one is refused', async () => {
  const prod = await serve(['--kv-transfer-config', '{"kv_role":"kv_producer","auth_token":"s3cret","lease_ms":500}']);
  const good = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer"}'], { TANDEM_KV_TOKEN: 's3cret' });
  const bad = await serve(['--kv-transfer-config', '{"kv_role":"kv_consumer","auth_token":"guess"}']);
  const p = prompts()[2];
  const r1 = await decode(good.url, p, await prefill(prod.url, p));
  assert.equal(r1.json.kv_transfer_params.kv_load, 'transferred', JSON.stringify(r1.json.kv_transfer_params));
  // The producer counts a read's bytes when the read ends, which may be after the
  // consumer has answered; once the lease is given back the count is final.
  await noLeaks(prod.url, 'producer after the good session');
  const before = await metrics(prod.url);
  const r2 = await decode(bad.url, p, await prefill(prod.url, p));
  assert.equal(r2.status, 200, r2.text);
  assert.equal(r2.json.kv_transfer_params.kv_load, 'recomputed');
  assert.match(r2.json.kv_transfer_params.kv_load_error, /auth/);
  assert.equal(r2.json.choices[0].text, await expected(p));
  const m = await metrics(prod.url);
  assert.ok(m.tandem_kv_handshakes_refused_total > before.tandem_kv_handshakes_refused_total);
  assert.equal(m.tandem_kv_sent_bytes_total, before.tandem_kv_sent_bytes_total, 'nothing sent to the wrong token');
  // The refused consumer could not release: the lease expires.
  await noLeaks(prod.url, 'producer after a refused session');
  for (const x of [prod, good, bad]) x.proc.kill('SIGKILL');
});

// A TCP proxy between consumer and producer agent that cuts every connection after
// `cut` bytes from the producer.
function cuttingProxy(target, cut) {
  return new Promise((resolve) => {
    const server = net.createServer((c) => {
      const up = net.connect(target, '127.0.0.1');
      let n = 0;
      c.on('data', (d) => up.write(d));
      up.on('data', (d) => {
        n += d.length;
        if (n > cut) { c.destroy(); up.destroy(); return; }
        c.write(d);
      });
      c.on('error', () => up.destroy());
      up.on('error', () => c.destroy());
      c.on('close', () => up.destroy());
    });
    server.listen(0, '127.0.0.1', () => resolve(server));
  });
}

test('a connection cut mid-transfer: recomputed', async () => {
  const p = prompts()[14]; // 110 tokens: 7 blocks, several KiB per layer
  const kv = await prefill(PROD.url, p);
  const proxy = await cuttingProxy(PROD.agentPort, 2000);
  const port = proxy.address().port;
  const r = await decode(CONS.url, p, { ...kv, remote_handshake_port: port, remote_port: port });
  proxy.close();
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed', JSON.stringify(r.json.kv_transfer_params));
  assert.equal(r.json.choices[0].text, await expected(p));
  await noLeaks(CONS.url, 'consumer after the cut');
  await noLeaks(PROD.url, 'producer after the cut'); // released by the consumer or expired
});

test('mismatched layouts are refused at the handshake, on both sides', async () => {
  // A router that forwards only the transfer fields: the kvx handshake must catch it.
  const strip = ({ block_size, kv_dtype, model_fingerprint, ...rest }) => rest;
  const cases = [
    [['--kv-cache-dtype', 'f32'], /kv_dtype/, prompts()[4]],
    [['--block-size', '32'], /block_size/, prompts()[3]], // 15 tokens: one block either way
  ];
  for (const [args, field, p] of cases) {
    // A consumer that cannot even handshake cannot release the lease: it expires.
    const prod = await serve([...args, '--kv-transfer-config', '{"kv_role":"kv_producer","lease_ms":400}']);
    const r = await decode(CONS.url, p, strip(await prefill(prod.url, p)));
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.kv_transfer_params.kv_load, 'recomputed');
    assert.match(r.json.kv_transfer_params.kv_load_error, field);
    assert.equal(r.json.choices[0].text, await expected(p));
    const m = await metrics(prod.url);
    assert.ok(m.tandem_kv_handshakes_refused_total >= 1);
    await noLeaks(prod.url, 'producer after a refused handshake');
    prod.proc.kill('SIGKILL');
  }
});

test('POST /kv_release gives a held transfer back at once; unknown ids are 404, bad bodies 400', async () => {
  const kv = await prefill(PROD.url, prompts()[7]);
  const before = await metrics(PROD.url);
  assert.ok(before.tandem_kv_blocks_used > 0, 'the prefill holds its KV');
  const rel = (body) => fetch(PROD.url + '/kv_release', { method: 'POST', headers: { 'content-type': 'application/json' },
    body: typeof body === 'string' ? body : JSON.stringify(body) });
  let r = await rel({ transfer_id: kv.transfer_id });
  assert.equal(r.status, 200, await r.text());
  await noLeaks(PROD.url, 'released producer');
  r = await rel({ transfer_id: kv.transfer_id });
  assert.equal(r.status, 404);
  assert.equal((await r.json()).error.param, 'transfer_id');
  for (const bad of ['{', '[]', { transfer_id: 7 }, {}]) assert.equal((await rel(bad)).status, 400);
  // the consumer that comes later recomputes: the request still ends with the right text
  const d = await decode(CONS.url, prompts()[7], kv);
  assert.equal(d.status, 200, d.text);
  assert.equal(d.json.choices[0].text, await expected(prompts()[7]));
  assert.equal(d.json.kv_transfer_params.kv_load, 'recomputed');
  // a server without a KV role holds nothing
  assert.equal((await fetch(AGG.url + '/kv_release', { method: 'POST', body: JSON.stringify({ transfer_id: kv.transfer_id }) })).status, 404);
});

test('every server is idle and healthy at the end, and shuts down cleanly', async () => {
  for (const s of [PROD, CONS, CONS_FAIL]) {
    await noLeaks(s.url, 'final');
    assert.equal((await fetch(s.url + '/health')).status, 200);
  }
  // SIGTERM: a clean exit (0), which under AddressSanitizer also means no leak.
  for (const s of [AGG, PROD, CONS, CONS_FAIL]) {
    const code = await new Promise((r) => { s.proc.on('exit', (c) => r(c)); s.proc.kill('SIGTERM'); });
    assert.equal(code, 0, s.stderr());
  }
});
