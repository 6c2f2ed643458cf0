// Helpers shared by the integration tests that drive tandem processes over HTTP.
import assert from 'node:assert/strict';

// A server's Prometheus metrics as {name{labels}: value}, without the model_name label.
export async function metrics(base) {
  const text = await (await fetch(base + '/metrics')).text();
  const m = {};
  for (const line of text.split('\n')) {
    const r = line.match(/^([a-z_]+(?:\{[^}]*\})?) (\S+)$/);
    if (r) m[r[1].replace(/\{model_name="[^"]*"\}/, '')] = Number(r[2]);
  }
  return m;
}

// Wait until f() is true (a deadline bounds the wait, it is not the assertion).
export async function until(f, what, ms = 20000) {
  const end = Date.now() + ms;
  for (;;) {
    if (await f()) return;
    if (Date.now() > end) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}
