// Calls to the daemon's /v1 API with the user's API key, and its OpenAI-style errors as ApiError.

export class ApiError extends Error {
  readonly status: number;
  readonly code: string | null;

  constructor(status: number, message: string, code: string | null = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

/** The message of an error body ({"error": {"message", "code"}}), whatever the server sent. */
export async function errorFrom(response: Response): Promise<ApiError> {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text) as { error?: { message?: string; code?: string } };
    if (body.error?.message) return new ApiError(response.status, body.error.message, body.error.code ?? null);
  } catch {
    // not JSON: fall through to the status line
  }
  return new ApiError(response.status, text.trim() || `${response.status} ${response.statusText}`);
}

export interface ApiOptions {
  /** The API key the user typed (EXO_API_KEY on the daemon), or null. */
  key: () => string | null;
  /** Called on every 401, so the page can ask for a key. */
  onUnauthorized?: (message: string) => void;
  base?: string;
  fetch?: typeof fetch;
}

export class Api {
  readonly base: string;
  private readonly options: ApiOptions;

  constructor(options: ApiOptions) {
    this.options = options;
    this.base = options.base ?? "";
  }

  headers(extra: Record<string, string> = {}): Record<string, string> {
    const key = this.options.key();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  /** A raw response (for streams); non-2xx answers become ApiError. */
  async send(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<Response> {
    const fetchImpl = this.options.fetch ?? fetch;
    const headers = this.headers(body === undefined ? {} : { "Content-Type": "application/json" });
    const response = await fetchImpl(this.base + path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
    if (!response.ok) {
      const error = await errorFrom(response);
      if (response.status === 401) this.options.onUnauthorized?.(error.message);
      throw error;
    }
    return response;
  }

  async json<T>(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
    const response = await this.send(method, path, body, signal);
    return (await response.json()) as T;
  }
}
