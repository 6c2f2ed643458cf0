/*
 * cli/up.c - `tandem up`: a whole local cluster from one command.
 *
 * It starts a router, then the engines (N prefill + M decode instances, or K aggregated
 * ones), each a `tandem serve` child with its own ports, its own log file and its own
 * CPUs (the machine's cores split between the engines without overlap, each engine's
 * threads pinned inside its share). In PD mode the engines register themselves with the
 * router (kv-transfer config proxy_ip / proxy_ping_port), so an engine that crashes and
 * is restarted (with backoff) is back behind the router without a router restart. It
 * waits until the router reports every role healthy, prints the URL and one line per
 * instance, writes the cluster's state to WORKDIR/cluster.json (for `tandem up
 * --status`), and on Ctrl-C or SIGTERM stops everything. Children also die with it
 * (PR_SET_PDEATHSIG), so nothing is orphaned even if it is killed.
 */
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "util/json.h"
#include "util/pool.h"
#include "util/td.h"

#define MAX_INST 33 /* 32 engines and the router */
#define MAX_PASS 64

typedef struct inst {
    char name[32];
    const char *role; /* "router", "prefill", "decode", "worker" */
    char addr[64];    /* where it listens */
    int port, hport;  /* HTTP port; KV handshake port (PD engines) */
    int cpu0, n_cpus; /* engines: CPUs [cpu0, cpu0 + n_cpus) of the allowed set; n 0 = all */
    bool lend;        /* those are its own; it may borrow the others' while they idle */
    int gpu;          /* engines with --gpus: the GPU they run on (--device cuda:N), else -1 */
    pid_t pid;
    int restarts;
    double backoff_s, started_at, restart_at;
    char log[512];
    char *argv[96];
    int argc;
} inst;

static volatile sig_atomic_t stop_requested;

static void on_stop(int sig)
{
    (void)sig;
    if (stop_requested < 2) stop_requested++; /* a second signal: stop now, no draining */
}

/* The lower end of the kernel's ephemeral port range (ip_local_port_range), 32768 where
 * it cannot be read. */
static int ephemeral_low(void)
{
    int lo = 32768, hi = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2 || lo < 1 || lo > 65535) lo = 32768;
        fclose(f);
    }
    return lo;
}

/* Whether a listener could bind port now: bound with SO_REUSEADDR on every address, as
 * the children's listeners are, and released at once. */
static bool port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return false;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_ANY)};
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    return ok;
}

/* A free port for a child to listen on, never one handed out before by this process. It is
 * drawn below the ephemeral range: a port from that range can be taken by any outgoing
 * connection on the machine between now and the child's bind, and again each time the child
 * is restarted on it, even by a connect to that very port while nothing listens there
 * (TCP's self-connect, as the router's health probe of a crashed engine can make), and the
 * child's bind then fails. Where no such range is left, the kernel picks (port 0). */
static int free_port(void)
{
    static int given[3 * MAX_INST + 1];
    static int n_given;
    static unsigned seed;
    if (!seed) seed = (unsigned)getpid() ^ (unsigned)time(NULL);
    int hi = ephemeral_low(), lo = hi - 10000 > 1024 ? hi - 10000 : 1024;
    for (int attempt = 0; hi - lo >= 64 && attempt < 1000; attempt++) {
        int port = lo + (int)(rand_r(&seed) % (unsigned)(hi - lo));
        bool used = false;
        for (int i = 0; i < n_given; i++)
            used |= given[i] == port;
        if (used || !port_free(port)) continue;
        if (n_given < (int)(sizeof(given) / sizeof(given[0]))) given[n_given++] = port;
        return port;
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static size_t sink(char *p, size_t size, size_t n, void *arg)
{
    (void)p;
    (void)arg;
    return size * n;
}

/* GET url; the HTTP status, or 0 when nothing answered. */
static long http_get(const char *url, double timeout_s)
{
    CURL *e = curl_easy_init();
    if (!e) return 0;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, sink);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    long code = 0;
    if (curl_easy_perform(e) == CURLE_OK) curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(e);
    return code;
}

static void inst_arg(inst *in, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void inst_arg(inst *in, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (in->argc < 95) in->argv[in->argc++] = strdup(buf);
    in->argv[in->argc] = NULL;
}

static pid_t inst_start(inst *in, const cpu_set_t *allowed)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* die with `tandem up`, whatever kills it */
        if (getppid() != parent) _exit(1);
        /* Its own process group: a terminal's Ctrl-C reaches `tandem up` alone, which then
         * stops each instance with one SIGTERM (a drain); a signal that reached them too
         * made up's SIGTERM their second one, "exit at once", dropping requests. */
        setpgid(0, 0);
        int fd = open(in->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (in->n_cpus > 0 && !in->lend) { /* the k-th .. of the CPUs we may use */
            cpu_set_t mine;
            CPU_ZERO(&mine);
            int k = 0;
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, allowed)) {
                    if (k >= in->cpu0 && k < in->cpu0 + in->n_cpus) CPU_SET(c, &mine);
                    k++;
                }
            sched_setaffinity(0, sizeof(mine), &mine);
        }
        execv("/proc/self/exe", in->argv);
        _exit(127);
    }
    in->pid = pid;
    in->started_at = td_now_s();
    return pid;
}

static void write_state(const char *path, const char *router_url, const inst *v, int n)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "router", router_url);
    cJSON_AddNumberToObject(root, "pid", getpid());
    cJSON *arr = cJSON_AddArrayToObject(root, "instances");
    for (int i = 0; i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        char url[96];
        snprintf(url, sizeof(url), "http://%s:%d", v[i].addr, v[i].port);
        cJSON_AddStringToObject(o, "name", v[i].name);
        cJSON_AddStringToObject(o, "role", v[i].role);
        cJSON_AddStringToObject(o, "url", url);
        cJSON_AddNumberToObject(o, "pid", v[i].pid);
        cJSON_AddNumberToObject(o, "restarts", v[i].restarts);
        cJSON_AddStringToObject(o, "log", v[i].log);
        cJSON_AddItemToArray(arr, o);
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    char tmp[600];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (f && s) {
        fputs(s, f);
        fclose(f);
        rename(tmp, path);
    } else if (f) {
        fclose(f);
    }
    free(s);
}

/* `tandem up --status`: what the state file says, checked against the live processes. */
static int status(const char *workdir)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/cluster.json", workdir);
    FILE *f = fopen(path, "r");
    if (!f) {
        /* cluster.json comes once the cluster is up; before that, its `up` holds the lock */
        char lock_path[600];
        snprintf(lock_path, sizeof(lock_path), "%s/lock", workdir);
        int fd = open(lock_path, O_RDONLY | O_CLOEXEC);
        bool held = fd >= 0 && flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        if (fd >= 0) close(fd);
        if (held)
            fprintf(stderr, "a cluster is starting from %s (its tandem up holds %s)\n", workdir,
                    lock_path);
        else
            fprintf(stderr, "no cluster is running from %s (no %s)\n", workdir, path);
        return 1;
    }
    char buf[65536];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(j, "pid");
    const cJSON *router = cJSON_GetObjectItemCaseSensitive(j, "router");
    if (!cJSON_IsNumber(pid) || !cJSON_IsString(router)) {
        fprintf(stderr, "%s is not a cluster state file\n", path);
        cJSON_Delete(j);
        return 1;
    }
    bool up_alive = kill((pid_t)pid->valuedouble, 0) == 0;
    printf("cluster %s: tandem up pid %d %s\n", router->valuestring, (int)pid->valuedouble,
           up_alive ? "running" : "GONE");
    int bad = !up_alive;
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(j, "instances"))
    {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
        const cJSON *url = cJSON_GetObjectItemCaseSensitive(it, "url");
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(it, "pid");
        const cJSON *rs = cJSON_GetObjectItemCaseSensitive(it, "restarts");
        if (!cJSON_IsString(nm) || !cJSON_IsString(url) || !cJSON_IsNumber(p)) continue;
        char h[300];
        snprintf(h, sizeof(h), "%s/health", url->valuestring);
        bool alive = kill((pid_t)p->valuedouble, 0) == 0;
        long code = alive ? http_get(h, 2) : 0;
        printf("  %-10s %-24s pid %-7d %-9s restarts %d\n", nm->valuestring, url->valuestring,
               (int)p->valuedouble, !alive ? "dead" : code == 200 ? "healthy" : "unhealthy",
               cJSON_IsNumber(rs) ? (int)rs->valuedouble : 0);
        bad += code != 200;
    }
    cJSON_Delete(j);
    return bad ? 1 : 0;
}

/* SIGTERM to v[i0 .. i1) and wait for them: each drains (finishes what it has, up to its
 * --shutdown-timeout of 30 s). A second signal to `tandem up`, before this or during it,
 * passes a second signal on (SIGINT: two SIGTERMs sent back to back could merge into one
 * pending signal), which makes them exit at once; past the drain and a grace, SIGKILL. */
static void stop_range(inst *v, int i0, int i1)
{
    /* SIGCONT after each: a stopped instance (SIGSTOP) would keep the SIGTERM pending until
     * the SIGKILL at the end of the grace. */
    for (int i = i0; i < i1; i++)
        if (v[i].pid > 0) {
            kill(v[i].pid, SIGTERM);
            kill(v[i].pid, SIGCONT);
        }
    bool hurried = false; /* the second signal passed on */
    double end = td_now_s() + 35;
    for (int i = i0; i < i1; i++) {
        while (v[i].pid > 0) {
            if (waitpid(v[i].pid, NULL, WNOHANG) == v[i].pid) break;
            if (!hurried && stop_requested > 1) {
                hurried = true;
                for (int k = i; k < i1; k++)
                    if (v[k].pid > 0) kill(v[k].pid, SIGINT);
            }
            if (td_now_s() > end) {
                kill(v[i].pid, SIGKILL);
                waitpid(v[i].pid, NULL, 0);
                break;
            }
            usleep(20000);
        }
        v[i].pid = 0;
    }
}

/* The router first (v[0] where this host runs it): it finishes the requests it relays,
 * which the engines are answering, and takes no more; then the engines, which then hold
 * nothing but KV still to be pulled. */
static void stop_all(inst *v, int n)
{
    bool router = n > 0 && !strcmp(v[0].role, "router");
    if (router) stop_range(v, 0, 1);
    stop_range(v, router ? 1 : 0, n);
}

static void tail_log(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    /* Its "error:" lines first, wherever they are (a flag error comes before the whole
     * usage text, which the tail alone would show), then its end. */
    char line[512];
    for (int shown = 0; shown < 10 && fgets(line, sizeof(line), f);)
        if (!strncmp(line, "error:", 6)) {
            fprintf(stderr, "%s: %s", path, line);
            shown++;
        }
    char buf[4096];
    fseek(f, 0, SEEK_END);
    long end = ftell(f);
    fseek(f, end > (long)sizeof(buf) - 1 ? end - (long)sizeof(buf) + 1 : 0, SEEK_SET);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = 0;
    fclose(f);
    fprintf(stderr, "--- %s (end) ---\n%s\n---\n", path, buf);
}

/*
 * A cluster over several hosts (--config FILE, --this-host NAME): every host runs
 * `tandem up` with the same file and its own name, starts its own engines (bound to its
 * address, registering with the router), and the host named in "router" also starts the
 * router. Keys (any other is an error):
 *   {"mode": "pd" | "aggregated", "model": PATH, "protocol": "tcp", "transfer_mode": "read",
 *    "engine_flags": ["--block-size", "16", ...],
 *    "router": {"host": NAME, "port": 8000},
 *    "hosts": [{"name": NAME, "address": ADDR, "prefill": N, "decode": M, "engines": K}]}
 * ("engines" is the count in aggregated mode).
 */
typedef struct up_plan {
    bool pd, router_here;
    const char *model, *protocol, *mode, *bind, *router_addr;
    int router_port;
    int64_t n_prefill, n_decode, n_agg;
    char *pass[MAX_PASS];
    int n_pass;
} up_plan;

static bool keys_ok(const cJSON *o, const char *const *keys, int n, const char *where)
{
    const cJSON *it;
    cJSON_ArrayForEach(it, o)
    {
        bool known = false;
        for (int i = 0; i < n; i++)
            known |= !strcmp(it->string, keys[i]);
        if (!known) {
            fprintf(stderr, "error: --config: unknown key '%s' in %s\n", it->string, where);
            return false;
        }
    }
    return true;
}

static const char *str_at(const cJSON *o, const char *k, const char *dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : v ? NULL : dflt;
}

static int64_t int_at(const cJSON *o, const char *k, int64_t dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!v) return dflt;
    /* An integer that fits (a wider double would be undefined to convert): else -1. */
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    return d >= -1e15 && d <= 1e15 && d == floor(d) ? (int64_t)d : -1;
}

/* Fill p from the config file for host `me`; the cJSON stays alive (strings point in). */
static int load_config(const char *path, const char *me, up_plan *p, cJSON **keep)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "error: --config: cannot read %s\n", path);
        return 2;
    }
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) return 1;
    buf[n] = 0;
    char why[160];
    cJSON *j = td_json_parse_strict(buf, n, why, sizeof(why));
    free(buf);
    *keep = j;
    if (!j) {
        fprintf(stderr, "error: --config: %s: %s\n", path, why);
        return 2;
    }
    static const char *const top[] = {"mode", "model", "protocol", "transfer_mode",
                                       "engine_flags", "router", "hosts"};
    static const char *const rkeys[] = {"host", "port"};
    static const char *const hkeys[] = {"name", "address", "prefill", "decode", "engines"};
    if (!cJSON_IsObject(j)) {
        fprintf(stderr, "error: --config: %s is not a JSON object\n", path);
        return 2;
    }
    if (!keys_ok(j, top, 7, "the file")) return 2;
    const char *mode = str_at(j, "mode", "pd");
    p->model = str_at(j, "model", p->model);
    p->protocol = str_at(j, "protocol", p->protocol);
    p->mode = str_at(j, "transfer_mode", p->mode);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "router");
    const cJSON *hosts = cJSON_GetObjectItemCaseSensitive(j, "hosts");
    if (cJSON_GetObjectItemCaseSensitive(j, "model") && !p->model) {
        fprintf(stderr, "error: --config: \"model\" must be a string (a GGUF path)\n");
        return 2;
    }
    if (!mode || (strcmp(mode, "pd") && strcmp(mode, "aggregated")) || !p->protocol ||
        !p->mode || !cJSON_IsObject(r) || !keys_ok(r, rkeys, 2, "router") ||
        !cJSON_IsArray(hosts) || cJSON_GetArraySize(hosts) < 1) {
        fprintf(stderr, "error: --config: needs \"router\": {\"host\", \"port\"}, a non-empty "
                        "\"hosts\" array, and mode pd or aggregated\n");
        return 2;
    }
    p->pd = !strcmp(mode, "pd");
    const char *rhost = str_at(r, "host", NULL);
    int64_t rport = int_at(r, "port", 8000);
    p->router_port = rport >= 1 && rport <= 65535 ? (int)rport : -1;
    const cJSON *h, *mine = NULL;
    int64_t tp = 0, td = 0, ta = 0;
    cJSON_ArrayForEach(h, hosts)
    {
        const char *name = str_at(h, "name", NULL), *addr = str_at(h, "address", NULL);
        int64_t np = int_at(h, "prefill", 0), nd = int_at(h, "decode", 0),
                ne = int_at(h, "engines", 0);
        if (!cJSON_IsObject(h) || !keys_ok(h, hkeys, 5, "a host") || !name || !addr || np < 0 ||
            nd < 0 || ne < 0 || np + nd + ne > MAX_INST - 1) {
            fprintf(stderr, "error: --config: each host needs a name, an address and counts "
                            "(prefill, decode; or engines) from 0 to 32\n");
            return 2;
        }
        /* counts of the other mode would be ignored: a typo in the recipe */
        const char *wrong = p->pd && cJSON_GetObjectItemCaseSensitive(h, "engines")    ? "engines"
                            : !p->pd && cJSON_GetObjectItemCaseSensitive(h, "prefill") ? "prefill"
                            : !p->pd && cJSON_GetObjectItemCaseSensitive(h, "decode")  ? "decode"
                                                                                       : NULL;
        if (wrong) {
            fprintf(stderr, "error: --config: host %s: \"%s\" is for %s mode (this is %s)\n", name,
                    wrong, p->pd ? "aggregated" : "pd", p->pd ? "pd" : "aggregated");
            return 2;
        }
        for (const cJSON *e = hosts->child; e != h; e = e->next)
            if (!strcmp(str_at(e, "name", ""), name)) {
                fprintf(stderr, "error: --config: two hosts are named %s\n", name);
                return 2;
            }
        if (me && !strcmp(name, me)) mine = h;
        if (rhost && !strcmp(name, rhost)) p->router_addr = addr;
        tp += np;
        td += nd;
        ta += ne;
    }
    if (!mine || !p->router_addr || p->router_port < 1 || p->router_port > 65535) {
        fprintf(stderr, "error: --config: %s\n",
                !mine ? "--this-host must name one of the hosts"
                      : "router.host must name one of the hosts, router.port a port");
        return 2;
    }
    if (p->pd ? (tp < 1 || td < 1) : ta < 1) {
        fprintf(stderr, "error: --config: the cluster needs %s\n",
                p->pd ? "a prefill and a decode engine" : "an engine");
        return 2;
    }
    p->bind = str_at(mine, "address", NULL);
    p->router_here = !strcmp(str_at(mine, "name", ""), rhost);
    p->n_prefill = p->pd ? int_at(mine, "prefill", 0) : 0;
    p->n_decode = p->pd ? int_at(mine, "decode", 0) : 0;
    p->n_agg = p->pd ? 0 : int_at(mine, "engines", 0);
    const cJSON *fl = cJSON_GetObjectItemCaseSensitive(j, "engine_flags");
    if (fl && !cJSON_IsArray(fl)) {
        fprintf(stderr, "error: --config: engine_flags must be an array of strings\n");
        return 2;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, fl)
    {
        if (!cJSON_IsString(it) || p->n_pass >= MAX_PASS) {
            fprintf(stderr, "error: --config: engine_flags must be at most %d strings\n", MAX_PASS);
            return 2;
        }
        p->pass[p->n_pass++] = it->valuestring;
    }
    return 0;
}

/* --gpus "0,1,...": GPU numbers 0..63, at most 64 of them. */
static int parse_gpus(const char *arg, int *gpus, int *n)
{
    *n = 0;
    for (const char *p = arg; *p;) {
        char *end = NULL;
        long g = strtol(p, &end, 10);
        if (end == p || g < 0 || g > 63 || *n >= 64 || (*end && *end != ',') || (*end == ',' && !end[1])) {
            fprintf(stderr, "error: --gpus must be a comma-separated list of GPU numbers (0..63), got '%s'\n", arg);
            return 2;
        }
        gpus[(*n)++] = (int)g;
        p = *end ? end + 1 : end;
    }
    if (!*n) {
        fprintf(stderr, "error: --gpus must name at least one GPU\n");
        return 2;
    }
    return 0;
}

int cli_up(int argc, char **argv)
{
    /* Everything after "--" goes to every engine. */
    int n_up = argc;
    char **pass = NULL;
    int n_pass = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--")) {
            n_up = i;
            pass = argv + i + 1;
            n_pass = argc - i - 1;
            break;
        }
    const char *model = NULL, *protocol = "tcp", *mode = "read", *host = "127.0.0.1",
               *workdir = ".tandem", *level = "warn", *config = NULL, *this_host = NULL, *gpus_arg = NULL;
    int64_t n_prefill = 1, n_decode = 1, n_agg = 0, port = 8000, threads = 0;
    bool want_status = false, no_lend = false;
    cli_flag f[] = {
        CLI_FLAG("model", CLI_FLAG_STR, &model,
                 "GGUF model (default: WORKDIR/models/llama-134m-f16.gguf, made by mkmodel "
                 "with random weights on first use)"),
        CLI_FLAG("prefill", CLI_FLAG_INT, &n_prefill, "prefill instances (1)"),
        CLI_FLAG("decode", CLI_FLAG_INT, &n_decode, "decode instances (1)"),
        CLI_FLAG("aggregated", CLI_FLAG_INT, &n_agg, "K plain engines instead of prefill/decode"),
        CLI_FLAG("protocol", CLI_FLAG_STR, &protocol,
                 "KV transfer: tcp | shm | ucx | cuda_ipc (tcp; cuda_ipc with -- --device cuda)"),
        CLI_FLAG("transfer-mode", CLI_FLAG_STR, &mode, "read | write (read)"),
        CLI_FLAG("host", CLI_FLAG_STR, &host, "the router's address (127.0.0.1)"),
        CLI_FLAG("port", CLI_FLAG_INT, &port, "the router's port (8000; 0 = a free one)"),
        CLI_FLAG("threads", CLI_FLAG_INT, &threads,
                 "threads per engine (0: the CPUs split evenly between the engines)"),
        CLI_FLAG("no-lend-cpus", CLI_FLAG_BOOL, &no_lend,
                 "keep each engine on its own CPUs even while another engine is idle"),
        CLI_FLAG("workdir", CLI_FLAG_STR, &workdir,
                 "logs, the state file and the default model (.tandem)"),
        CLI_FLAG("log-level", CLI_FLAG_STR, &level, "the instances' log level (warn)"),
        CLI_FLAG("status", CLI_FLAG_BOOL, &want_status,
                 "report on the cluster running from WORKDIR"),
        CLI_FLAG("config", CLI_FLAG_STR, &config,
                 "a JSON file describing a cluster over several hosts (see README)"),
        CLI_FLAG("this-host", CLI_FLAG_STR, &this_host, "with --config: which host this is"),
        CLI_FLAG("gpus", CLI_FLAG_STR, &gpus_arg,
                 "GPUs for the engines, e.g. 0,1: prefill instances first, then decode, one GPU "
                 "each in turn (each engine gets --device cuda:N)"),
    };
    int rc = cli_flags_parse(f, (int)TD_ARRAY_LEN(f), n_up, argv,
                             "tandem up [--prefill N --decode M | --aggregated K] [options] "
                             "[-- ENGINE FLAGS...]");
    if (rc) return rc == 1 ? 0 : 2;
    int gpus[64], n_gpus = 0;
    if (gpus_arg && parse_gpus(gpus_arg, gpus, &n_gpus)) return 2;
    if (gpus_arg && config) {
        fprintf(stderr, "error: --gpus is for a cluster on this host; with --config, give each host's "
                        "engines their --device in engine_flags\n");
        return 2;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (want_status) {
        rc = status(workdir);
        curl_global_cleanup();
        return rc;
    }
    up_plan plan = {.pd = n_agg == 0,
                    .router_here = true,
                    .model = model,
                    .protocol = protocol,
                    .mode = mode,
                    .bind = "127.0.0.1",
                    .router_addr = host,
                    .router_port = (int)port,
                    .n_prefill = n_prefill,
                    .n_decode = n_decode,
                    .n_agg = n_agg};
    cJSON *cfg_json = NULL;
    if (config) {
        if (n_pass || !this_host) {
            fprintf(stderr, "error: --config takes --this-host NAME, and the engine flags from "
                            "the file (engine_flags), not after --\n");
            return 2;
        }
        if ((rc = load_config(config, this_host, &plan, &cfg_json))) {
            cJSON_Delete(cfg_json);
            return rc;
        }
        model = plan.model;
        protocol = plan.protocol;
        mode = plan.mode;
        host = plan.router_addr;
        port = plan.router_port;
        n_prefill = plan.n_prefill;
        n_decode = plan.n_decode;
        n_agg = plan.n_agg;
        pass = plan.pass;
        n_pass = plan.n_pass;
    } else if (this_host) {
        fprintf(stderr, "error: --this-host goes with --config\n");
        return 2;
    }
    bool pd = plan.pd;
    /* Engines register themselves with the router in PD mode, and everywhere in a
     * multi-host cluster (as kv_both in aggregated mode). */
    bool reg = pd || config;
    /* each count on its own first: their sum must not wrap */
    if (n_prefill < 0 || n_prefill > MAX_INST || n_decode < 0 || n_decode > MAX_INST || n_agg < 0 ||
        n_agg > MAX_INST) {
        fprintf(stderr, "error: --prefill, --decode and --aggregated take 0 to %d engines\n",
                MAX_INST - 1);
        return 2;
    }
    /* Flags that up gives every engine itself: a second one would win over up's and leave
     * the cluster waiting for an engine that is elsewhere. */
    static const char *const up_sets[] = {"--model", "--host", "--server-port", "--port",
                                          "--kv-transfer-config"};
    for (int k = 0; k < n_pass; k++)
        for (size_t j = 0; j < TD_ARRAY_LEN(up_sets); j++) {
            size_t len = strlen(up_sets[j]);
            char alt[32]; /* the underscore spelling every flag also takes */
            snprintf(alt, sizeof(alt), "%s", up_sets[j]);
            for (char *c = alt + 2; *c; c++)
                if (*c == '-') *c = '_';
            if ((!strncmp(pass[k], up_sets[j], len) || !strncmp(pass[k], alt, len)) &&
                (pass[k][len] == 0 || pass[k][len] == '=')) {
                fprintf(stderr,
                        "error: %s after -- : tandem up sets it for every engine itself (%s)\n",
                        pass[k],
                        j == 0   ? "use --model"
                        : j == 4 ? "use --protocol and --transfer-mode"
                                 : "each engine gets its own port; --host is the router's");
                return 2;
            }
        }
    int n_eng = pd ? (int)(n_prefill + n_decode) : (int)n_agg;
    if ((pd && !config && (n_prefill < 1 || n_decode < 1)) || n_agg < 0 ||
        (n_eng < 1 && !plan.router_here) || n_eng > MAX_INST - 1 ||
        port < 0 || port > 65535 || threads < 0 || threads > 1024 || n_pass > MAX_PASS ||
        (strcmp(protocol, "tcp") && strcmp(protocol, "shm") && strcmp(protocol, "ucx") &&
         strcmp(protocol, "cuda_ipc")) ||
        (strcmp(mode, "read") && strcmp(mode, "write"))) {
        fprintf(stderr, "error: --prefill and --decode at least 1 (or --aggregated K), at most "
                        "32 engines; --protocol tcp|shm|ucx|cuda_ipc; --transfer-mode read|write\n");
        return 2;
    }
    if (mkdir(workdir, 0755) && errno != EEXIST) {
        fprintf(stderr, "error: cannot create %s: %s\n", workdir, strerror(errno));
        return 1;
    }
    /* One cluster per workdir: its state, logs and CPU board are there. The lock goes with
     * this process (closed at exec in the children). */
    char lock_path[600];
    snprintf(lock_path, sizeof(lock_path), "%s/lock", workdir);
    int lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) { /* not a directory we may write in: say so, not "another up" */
        fprintf(stderr, "error: cannot create %s: %s\n", lock_path, strerror(errno));
        return 1;
    }
    if (flock(lock_fd, LOCK_EX | LOCK_NB)) {
        fprintf(stderr,
                "error: another `tandem up` runs from %s (its lock %s is held); give "
                "this one its own --workdir\n",
                workdir, lock_path);
        close(lock_fd);
        return 1;
    }
    /* a state file left by a cluster that was killed describes nothing now (--status) */
    char state_path[600];
    snprintf(state_path, sizeof(state_path), "%s/cluster.json", workdir);
    unlink(state_path);
    /* A port asked for must be free now: a second cluster on it would wait for health
     * from the first cluster's router, and register its engines there. */
    if (port && plan.router_here && !port_free((int)port)) {
        fprintf(stderr,
                "error: port %lld is in use (another cluster or server?): choose another "
                "--port\n",
                (long long)port);
        close(lock_fd);
        return 1;
    }
    char model_path[600];
    if (!model) { /* a model at a real shape that works on a fresh machine */
        char dir[500];
        snprintf(dir, sizeof(dir), "%s/models", workdir);
        mkdir(dir, 0755);
        snprintf(model_path, sizeof(model_path), "%s/llama-134m-f16.gguf", dir);
        if (access(model_path, R_OK)) {
            fprintf(stderr, "tandem up: writing %s (random weights, tandem mkmodel)\n", model_path);
            /* Written beside, then renamed: a run stopped mid-write leaves no truncated
             * model for the next one to take. */
            char tmp_path[620];
            snprintf(tmp_path, sizeof(tmp_path), "%s.tmp", model_path);
            pid_t parent = getpid(), p = fork();
            if (p == 0) {
                prctl(PR_SET_PDEATHSIG, SIGTERM); /* dies with `tandem up` */
                if (getppid() != parent) _exit(1);
                execl("/proc/self/exe", "tandem", "mkmodel", "--preset", "llama-134m", "--type",
                      "f16", "--out", tmp_path, (char *)NULL);
                _exit(127);
            }
            int st = 0;
            if (p < 0 || waitpid(p, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) ||
                rename(tmp_path, model_path)) {
                fprintf(stderr, "error: mkmodel failed\n");
                unlink(tmp_path);
                close(lock_fd);
                return 1;
            }
        }
        model = model_path;
    }

    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed)) CPU_ZERO(&allowed);
    int n_cpu = CPU_COUNT(&allowed);
    if (n_cpu < 1) n_cpu = 1;
    /* whole CPUs per engine; 0 when there are more engines, or none here (a host that runs
     * only the router) */
    int share = n_eng > 0 ? n_cpu / n_eng : 0;
    /* Engines that split the CPUs lend theirs to each other while idle (a CPU board in the
     * workdir; docs/ARCHITECTURE.md), unless told not to or they compute elsewhere or place
     * their threads themselves. */
    bool lend = !no_lend && share > 0 && n_eng > 1 && !threads && !n_gpus;
    static const char *const own_placement[] = {
        "--device",         "--cpus", "--cpu-board",         "--threads",
        "--no-pin-threads", "--dp",   "--data-parallel-size"};
    for (int k = 0; k < n_pass && lend; k++)
        for (size_t j = 0; j < TD_ARRAY_LEN(own_placement); j++)
            if (!strcmp(pass[k], own_placement[j])) lend = false;
    char board[600];
    snprintf(board, sizeof(board), "%s/cpu-board", workdir);
    unlink(board); /* a fresh board: none of a previous cluster's marks */

    inst *v = calloc(MAX_INST, sizeof(inst));
    int n = 0;
    int rport = port ? (int)port : free_port();
    int first_engine = plan.router_here ? 1 : 0;
    char router_url[128];
    snprintf(router_url, sizeof(router_url), "http://%s:%d", host, rport);
    /* The router: PD engines register themselves; aggregated engines are given. On a host
     * without the router, r is a scratch slot that is never started. */
    inst scratch = {0};
    inst *r = plan.router_here ? &v[n++] : &scratch;
    snprintf(r->name, sizeof(r->name), "router");
    r->role = "router";
    r->port = rport;
    snprintf(r->addr, sizeof(r->addr), "%s", !strcmp(host, "0.0.0.0") ? "127.0.0.1" : host);
    inst_arg(r, "tandem");
    inst_arg(r, "router");
    inst_arg(r, "--host");
    inst_arg(r, "%s", host);
    inst_arg(r, "--port");
    inst_arg(r, "%d", rport);
    inst_arg(r, "--log-level");
    inst_arg(r, "%s", level);
    inst_arg(r, "--health-check-interval-secs");
    inst_arg(r, "1");
    if (pd) inst_arg(r, "--pd-disaggregation");
    for (int i = 0; i < n_eng; i++) {
        inst *e = &v[n++];
        e->role = !pd ? "worker" : i < n_prefill ? "prefill" : "decode";
        snprintf(e->name, sizeof(e->name), "%s-%d", e->role,
                 !pd ? i : i < n_prefill ? i : i - (int)n_prefill);
        snprintf(e->addr, sizeof(e->addr), "%s", plan.bind);
        e->port = free_port();
        e->hport = pd ? free_port() : 0;
        if (e->port <= 0 || (pd && e->hport <= 0)) {
            fprintf(stderr, "error: no free port\n");
            return 1;
        }
        e->n_cpus = share > 0 ? share : 0;
        e->cpu0 = share > 0 ? i * share : 0;
        int t = threads ? (int)threads : share > 0 ? share : 1;
        inst_arg(e, "tandem");
        inst_arg(e, "serve");
        inst_arg(e, "--model");
        inst_arg(e, "%s", model);
        inst_arg(e, "--host");
        inst_arg(e, "%s", plan.bind);
        inst_arg(e, "--server-port");
        inst_arg(e, "%d", e->port);
        inst_arg(e, "--threads");
        inst_arg(e, "%d", t);
        if (lend) {
            cpu_set_t mine;
            CPU_ZERO(&mine);
            for (int c = 0, k = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &allowed)) {
                    if (k >= e->cpu0 && k < e->cpu0 + e->n_cpus) CPU_SET(c, &mine);
                    k++;
                }
            char list[1000];
            td_format_cpu_list(&mine, list, sizeof(list));
            e->lend = true;
            inst_arg(e, "--cpus");
            inst_arg(e, "%s", list);
            inst_arg(e, "--cpu-board");
            inst_arg(e, "%s", board);
        }
        inst_arg(e, "--log-level");
        inst_arg(e, "%s", level);
        if (reg) {
            inst_arg(e, "--kv-transfer-config");
            inst_arg(e,
                     "{\"kv_role\":\"%s\",\"protocol\":\"%s\",\"transfer_mode\":\"%s\","
                     "\"handshake_port\":%d,\"kv_ip\":\"%s\",\"proxy_ip\":\"%s\","
                     "\"proxy_ping_port\":%d}",
                     !pd ? "kv_both" : i < n_prefill ? "kv_producer" : "kv_consumer", protocol,
                     mode, e->hport ? e->hport : free_port(), plan.bind,
                     !strcmp(host, "0.0.0.0") ? "127.0.0.1" : host, rport);
        } else {
            inst_arg(r, "--worker");
            inst_arg(r, "http://127.0.0.1:%d", e->port);
        }
        for (int k = 0; k < n_pass; k++)
            inst_arg(e, "%s", pass[k]);
        e->gpu = n_gpus ? gpus[i % n_gpus] : -1;
        if (e->gpu >= 0) { /* after the pass-through flags: the last --device wins */
            inst_arg(e, "--device");
            inst_arg(e, "cuda:%d", e->gpu);
        }
    }
    for (int i = 0; i < n; i++) {
        snprintf(v[i].log, sizeof(v[i].log), "%s/%s.log", workdir, v[i].name);
        unlink(v[i].log);
        v[i].backoff_s = 0.5;
    }

    /* Each handler blocks both signals: a SIGTERM that nested inside the SIGINT handler,
     * between its read and its write of the count, lost one signal (Ctrl-C then SIGTERM
     * read as one, and the cluster drained rather than stopping at once). */
    struct sigaction sa = {.sa_handler = on_stop};
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    char state[600];
    snprintf(state, sizeof(state), "%s/cluster.json", workdir);
    for (int i = 0; i < n; i++)
        if (inst_start(&v[i], &allowed) < 0) {
            fprintf(stderr, "error: cannot start %s\n", v[i].name);
            stop_all(v, n);
            return 1;
        }
    /* Ready when the router says every role it needs can take requests and every engine
     * of this host answers its own /health (so that none is still starting, or failing to,
     * when "ready" is printed). */
    char health[200];
    snprintf(health, sizeof(health), "http://%s:%d/health",
             !strcmp(host, "0.0.0.0") ? "127.0.0.1" : host, rport);
    double deadline = td_now_s() + 300;
    rc = 0;
    while (!stop_requested) {
        bool ready = plan.router_here ? http_get(health, 1) == 200 : true;
        for (int i = first_engine; i < n && ready; i++) {
            char h[200];
            snprintf(h, sizeof(h), "http://%s:%d/health", v[i].addr, v[i].port);
            ready = http_get(h, 1) == 200;
        }
        if (ready) break;
        for (int i = 0; i < n; i++) {
            int st;
            if (waitpid(v[i].pid, &st, WNOHANG) == v[i].pid) {
                fprintf(stderr, "error: %s exited during start-up (status %d)\n", v[i].name,
                        WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
                tail_log(v[i].log);
                v[i].pid = 0;
                rc = 1;
            }
        }
        if (rc || td_now_s() > deadline) {
            if (!rc) fprintf(stderr, "error: the cluster was not healthy after 300 s\n");
            stop_all(v, n);
            return 1;
        }
        usleep(100000);
    }
    if (stop_requested) { /* Ctrl-C or SIGTERM during start-up: never "ready" */
        fprintf(stderr, "tandem up: stopped during start-up\n");
        stop_all(v, n);
        close(lock_fd);
        return 1;
    }
    write_state(state, router_url, v, n);
    printf("tandem up: %s (%s, %s; %d CPU%s)\n", router_url,
           pd ? "prefill/decode" : "aggregated", model, n_cpu, n_cpu == 1 ? "" : "s");
    for (int i = 0; i < n; i++) {
        char cpus[32] = "shared";
        if (v[i].n_cpus > 0)
            snprintf(cpus, sizeof(cpus), "cpus %d-%d%s", v[i].cpu0, v[i].cpu0 + v[i].n_cpus - 1,
                     v[i].lend ? " +lent" : "");
        char url[96];
        snprintf(url, sizeof(url), "http://%s:%d", v[i].addr, v[i].port);
        if (v[i].gpu >= 0 && strcmp(v[i].role, "router")) {
            size_t l = strlen(cpus);
            snprintf(cpus + l, sizeof(cpus) - l, ", gpu %d", v[i].gpu);
        }
        printf("  %-10s %-24s pid %-7d %-10s log %s\n", v[i].name, url, (int)v[i].pid,
               !strcmp(v[i].role, "router") ? "" : cpus, v[i].log);
    }
    printf("ready: send requests to %s/v1/completions (Ctrl-C stops the cluster)\n", router_url);
    fflush(stdout);

    /* Watch: restart what dies, with backoff; a long healthy run resets the backoff. */
    while (!stop_requested) {
        usleep(100000);
        double now = td_now_s();
        bool changed = false;
        for (int i = 0; i < n; i++) {
            inst *in = &v[i];
            int st;
            if (in->pid > 0 && waitpid(in->pid, &st, WNOHANG) == in->pid) {
                if (now - in->started_at > 60) in->backoff_s = 0.5;
                fprintf(stderr, "tandem up: %s (pid %d) exited (%s %d); restarting in %.1f s\n",
                        in->name, (int)in->pid, WIFEXITED(st) ? "status" : "signal",
                        WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), in->backoff_s);
                in->pid = 0;
                in->restart_at = now + in->backoff_s;
                in->backoff_s = TD_MIN(in->backoff_s * 2, 30.0);
            }
            if (in->pid == 0 && now >= in->restart_at && !stop_requested) {
                if (inst_start(in, &allowed) > 0) {
                    in->restarts++;
                    changed = true;
                    fprintf(stderr, "tandem up: %s restarted (pid %d)\n", in->name,
                            (int)in->pid);
                }
            }
        }
        if (changed) write_state(state, router_url, v, n);
    }
    fprintf(stderr, "tandem up: stopping\n");
    stop_all(v, n);
    unlink(state);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < v[i].argc; k++)
            free(v[i].argv[k]);
    for (int k = 0; k < scratch.argc; k++) /* the router's arguments, on a host without it */
        free(scratch.argv[k]);
    free(v);
    cJSON_Delete(cfg_json);
    curl_global_cleanup();
    close(lock_fd);
    return 0;
}
