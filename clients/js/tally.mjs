// @ts-check
/**
 * The reference client of tally's HTTP API: an ES module with no
 * dependencies and no build step (browsers and Node 18+).
 *
 * What it gets right, so integrators need not:
 * - one Idempotency-Key per user action, reused unchanged on every retry of
 *   it (a new key per retry could let an old click land after a newer one);
 * - the final state is sent (`like`, `dislike`, `none`), never a toggle;
 * - transport errors, 5xx and `outcome_unknown` are retried with the same
 *   key, with exponential backoff and full jitter; 429 and 503 wait for
 *   their `Retry-After`;
 * - a page's ids are deduplicated and read in batches of at most 100.
 *
 * @module tally
 */

/** @typedef {"like" | "dislike" | "none"} Action */
/** @typedef {"video" | "comment"} TargetType */
/**
 * @typedef {object} Counts
 * @property {number} likes
 * @property {number} dislikes
 * @property {Action} user_state  what the caller's button shows
 */
/** @typedef {Counts & { target_id: string }} VoteAnswer */

/** The most ids one summary request may carry. */
export const MAX_IDS = 100;

/** A refusal the client does not retry: the vote was not recorded. */
export class VoteRefused extends Error {
  /**
   * @param {number} status
   * @param {string} code
   * @param {string} message
   */
  constructor(status, code, message) {
    super(message);
    this.name = "VoteRefused";
    this.status = status;
    this.code = code;
  }
}

export class TallyClient {
  /**
   * @param {object} options
   * @param {string} options.baseUrl  e.g. `https://api.example.com`
   * @param {() => string | Promise<string>} options.token  the user's bearer token
   * @param {number} [options.maxAttempts]  tries of one action (default 6)
   * @param {number} [options.baseDelayMs]  first backoff (default 200 ms)
   * @param {number} [options.maxDelayMs]  longest wait between tries (default 10 s)
   * @param {number} [options.timeoutMs]  one request's deadline (default 10 s)
   * @param {typeof fetch} [options.fetch]
   */
  constructor({ baseUrl, token, maxAttempts = 6, baseDelayMs = 200, maxDelayMs = 10_000, timeoutMs = 10_000, fetch: f }) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.token = token;
    this.maxAttempts = maxAttempts;
    this.baseDelayMs = baseDelayMs;
    this.maxDelayMs = maxDelayMs;
    this.timeoutMs = timeoutMs;
    this.fetch = f ?? globalThis.fetch.bind(globalThis);
  }

  /**
   * Sets the caller's reaction to a target: one user action, one key,
   * retried until answered or refused. Resolves with the counts after the
   * vote; rejects with `VoteRefused` for a 4xx, or the last error once
   * `maxAttempts` tries have failed (the vote may then still have been
   * recorded: retrying it with `key` is safe).
   *
   * @param {string} targetId
   * @param {TargetType} targetType
   * @param {Action} action
   * @param {{ key?: string, signal?: AbortSignal }} [options]
   * @returns {Promise<VoteAnswer>}
   */
  async vote(targetId, targetType, action, { key = crypto.randomUUID(), signal } = {}) {
    const body = JSON.stringify({ target_id: targetId, target_type: targetType, action });
    let lastError = /** @type {unknown} */ (undefined);
    for (let attempt = 0; attempt < this.maxAttempts; attempt++) {
      let wait = this.backoff(attempt);
      try {
        const res = await this.request("/v1/votes", {
          method: "POST",
          headers: { "Content-Type": "application/json", "Idempotency-Key": key },
          body,
          signal,
        });
        if (res.ok) return /** @type {VoteAnswer} */ (await res.json());
        const error = await errorOf(res);
        const retryAfter = Number(res.headers.get("Retry-After"));
        if (res.status === 429 || res.status === 503) {
          if (retryAfter > 0) wait = Math.max(wait, retryAfter * 1000);
          lastError = new VoteRefused(res.status, error.code, error.message);
        } else if (res.status >= 500) {
          lastError = new VoteRefused(res.status, error.code, error.message);
        } else {
          // 4xx: the request itself is wrong, or its key was used for another.
          throw new VoteRefused(res.status, error.code, error.message);
        }
      } catch (e) {
        if (e instanceof VoteRefused && e.status < 500 && e.status !== 429) throw e;
        if (signal?.aborted) throw e;
        lastError = e;
      }
      if (attempt + 1 < this.maxAttempts) await sleep(wait, signal);
    }
    throw lastError;
  }

  /**
   * The counts of a page's targets and the caller's state on each: ids
   * deduplicated, read in batches of `MAX_IDS`, in parallel.
   *
   * @param {string[]} ids
   * @returns {Promise<Record<string, Counts>>}
   */
  async summary(ids) {
    const unique = [...new Set(ids)];
    const batches = [];
    for (let i = 0; i < unique.length; i += MAX_IDS) batches.push(unique.slice(i, i + MAX_IDS));
    const pages = await Promise.all(
      batches.map(async (batch) => {
        for (let attempt = 0; ; attempt++) {
          const res = await this.request(`/v1/votes/summary?target_ids=${batch.map(encodeURIComponent).join(",")}`, {});
          if (res.ok) return /** @type {{ items: Record<string, Counts> }} */ (await res.json()).items;
          const error = await errorOf(res);
          const retryable = res.status === 429 || res.status >= 500;
          if (!retryable || attempt + 1 >= this.maxAttempts) throw new VoteRefused(res.status, error.code, error.message);
          const retryAfter = Number(res.headers.get("Retry-After"));
          await sleep(Math.max(this.backoff(attempt), retryAfter > 0 ? retryAfter * 1000 : 0));
        }
      }),
    );
    return Object.assign({}, ...pages);
  }

  /**
   * @param {string} path
   * @param {RequestInit} init
   */
  async request(path, init) {
    // The caller's signal or the deadline, whichever comes first (by hand:
    // AbortSignal.any is newer than Node 18).
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(new Error("timed out")), this.timeoutMs);
    init.signal?.addEventListener("abort", () => controller.abort(init.signal?.reason));
    const token = await this.token();
    try {
      return await this.fetch(this.baseUrl + path, {
        ...init,
        signal: controller.signal,
        headers: { ...(init.headers ?? {}), Authorization: `Bearer ${token}` },
      });
    } finally {
      clearTimeout(timer);
    }
  }

  /** Full jitter: a random wait up to the attempt's exponential bound. @param {number} attempt */
  backoff(attempt) {
    const bound = Math.min(this.maxDelayMs, this.baseDelayMs * 2 ** attempt);
    return Math.random() * bound;
  }
}

/**
 * A button's state for one target, drawn at once and made true by the
 * server's answers. A click draws its state immediately and sends it; a
 * double click is one click; a click while another is in flight only
 * changes what is sent next (the final state wins, and no action is sent
 * twice); a refusal rolls back to the last state the server confirmed, with
 * a message.
 */
export class Reaction {
  /**
   * @param {TallyClient} client
   * @param {string} targetId
   * @param {TargetType} targetType
   * @param {Counts} confirmed  the counts and state the server last said
   * @param {(view: { counts: Counts, pending: boolean, error?: string }) => void} render
   * @param {{ doubleClickMs?: number }} [options]  a second click on the same
   *   button this soon after the first is the same click (default 400 ms)
   */
  constructor(client, targetId, targetType, confirmed, render, { doubleClickMs = 400 } = {}) {
    this.doubleClickMs = doubleClickMs;
    /** @type {{ button: string, at: number } | undefined} */
    this.lastClick = undefined;
    /** @type {Action | undefined} the state being sent */
    this.inFlight = undefined;
    this.client = client;
    this.targetId = targetId;
    this.targetType = targetType;
    this.confirmed = { ...confirmed };
    this.render = render;
    /** @type {Action | undefined} the state wanted and not yet sent */
    this.wanted = undefined;
    this.sending = false;
    /** Moves with every answer this button takes: see `refresh`. */
    this.generation = 0;
    this.render({ counts: this.confirmed, pending: false });
  }

  /**
   * Counts read elsewhere (a summary, another tab's vote), taken only if
   * nothing happened to this button since the read began: no vote wanted or
   * in flight, and no answer since `generation` (read it before the read),
   * which would be newer than what the read saw.
   *
   * @param {Counts} counts
   * @param {number} generation  `this.generation` when the read began
   * @returns {boolean} whether the counts were taken
   */
  refresh(counts, generation) {
    if (this.sending || this.wanted !== undefined || generation !== this.generation) return false;
    this.confirmed = { likes: counts.likes, dislikes: counts.dislikes, user_state: counts.user_state };
    this.generation++;
    this.render({ counts: this.confirmed, pending: false });
    return true;
  }

  /** What the user sees: the confirmed counts moved to the wanted state. */
  view() {
    const want = this.wanted ?? this.inFlight ?? this.confirmed.user_state;
    return shown(this.confirmed, want);
  }

  /**
   * A click on a button: `like` on a liked target means `none`.
   * @param {"like" | "dislike"} button
   */
  click(button) {
    const now = Date.now();
    if (this.lastClick?.button === button && now - this.lastClick.at < this.doubleClickMs) return;
    this.lastClick = { button, at: now };
    const current = this.wanted ?? this.inFlight ?? this.confirmed.user_state;
    this.wanted = current === button ? "none" : button;
    this.render({ counts: this.view(), pending: true });
    void this.flush();
  }

  async flush() {
    if (this.sending) return;
    this.sending = true;
    try {
      while (this.wanted !== undefined) {
        const action = this.wanted;
        this.wanted = undefined;
        if (action === this.confirmed.user_state) continue;
        this.inFlight = action;
        try {
          const answer = await this.client.vote(this.targetId, this.targetType, action);
          this.confirmed = { likes: answer.likes, dislikes: answer.dislikes, user_state: answer.user_state };
          this.generation++;
        } catch (e) {
          this.wanted = undefined;
          this.inFlight = undefined;
          const message = e instanceof Error ? e.message : String(e);
          this.render({ counts: this.confirmed, pending: false, error: message });
          return;
        }
        this.inFlight = undefined;
      }
      this.render({ counts: this.confirmed, pending: false });
    } finally {
      this.sending = false;
    }
  }
}

/**
 * `counts` as they will be once the caller's state is `want`.
 * @param {Counts} counts
 * @param {Action} want
 * @returns {Counts}
 */
export function shown(counts, want) {
  const next = { ...counts };
  if (counts.user_state === "like") next.likes -= 1;
  if (counts.user_state === "dislike") next.dislikes -= 1;
  if (want === "like") next.likes += 1;
  if (want === "dislike") next.dislikes += 1;
  next.user_state = want;
  return next;
}

/** @param {Response} res */
async function errorOf(res) {
  try {
    const body = await res.json();
    return { code: String(body?.error?.code ?? res.status), message: String(body?.error?.message ?? res.statusText) };
  } catch {
    return { code: String(res.status), message: res.statusText };
  }
}

/**
 * @param {number} ms
 * @param {AbortSignal} [signal]
 */
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason);
    });
  });
}
