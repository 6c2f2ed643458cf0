/*
 * cli/mkmodel.c - `tandem mkmodel`: write a GGUF with random weights at a chosen
 * shape (a preset, with any dimension overridden by flags), dense or with experts.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "model/mkmodel.h"
#include "model/model.h"

static const char *usage_line =
    "tandem mkmodel --out PATH [--preset NAME] [--arch llama|qwen2|qwen2moe] [--dim N --layers N "
    "--heads N --kv-heads N --ffn N --vocab N --ctx N --rope-theta X] [--experts N "
    "--experts-used K --expert-ffn N --shared-ffn N] "
    "[--type f32|f16|bf16|q8_0|q4_0] [--vocab-from PATH] [--seed N]";

/* Check an explicitly given dimension and store it; 2 (usage error) if out of range. */
static int take_dim(const cli_flag *f, int64_t v, int64_t max, int *dst)
{
    if (!f->seen) return 0;
    if (v < 1 || v > max) {
        fprintf(stderr, "error: mkmodel: --%s %lld is out of range (1..%lld)\n", f->name,
                (long long)v, (long long)max);
        return 2;
    }
    *dst = (int)v;
    return 0;
}

/*
 * Apply --experts, --experts-used, --expert-ffn and --shared-ffn to a shape whose
 * architecture is final. Llama experts are --ffn wide; qwen2moe's experts and shared
 * expert default to --ffn. Returns 2 (usage error) with a message.
 */
static int take_experts(const cli_flag *f_exp, int64_t experts, const cli_flag *f_used,
                        int64_t used, const cli_flag *f_effn, int64_t effn, const cli_flag *f_sffn,
                        int64_t sffn, td_model_shape *s)
{
    if (f_exp->seen) {
        if (experts < 0 || experts > 512) {
            fprintf(stderr, "error: mkmodel: --experts %lld is out of range (0..512; 0 = dense)\n",
                    (long long)experts);
            return 2;
        }
        s->n_expert = (int)experts;
    }
    if (s->n_expert == 0) {
        if (f_used->seen || f_effn->seen || f_sffn->seen) {
            fprintf(stderr, "error: mkmodel: --experts-used, --expert-ffn and --shared-ffn need "
                            "--experts N\n");
            return 2;
        }
        if (s->arch == TD_ARCH_QWEN2MOE) {
            fprintf(stderr, "error: mkmodel: --arch qwen2moe needs --experts N\n");
            return 2;
        }
        s->n_expert_used = s->n_ff_exp = s->n_ff_shexp = 0;
        return 0;
    }
    if (s->arch == TD_ARCH_QWEN2) {
        fprintf(stderr, "error: mkmodel: qwen2 has no experts (use --arch qwen2moe)\n");
        return 2;
    }
    int rc = 0;
    if ((rc = take_dim(f_used, used, 512, &s->n_expert_used))) return rc;
    if (!s->n_expert_used) s->n_expert_used = TD_MIN(2, s->n_expert);
    if (s->n_expert_used > s->n_expert) {
        fprintf(stderr, "error: mkmodel: --experts-used %d must be at most --experts %d\n",
                s->n_expert_used, s->n_expert);
        return 2;
    }
    if (s->arch == TD_ARCH_LLAMA) {
        if (f_effn->seen || f_sffn->seen) {
            fprintf(stderr, "error: mkmodel: llama experts are --ffn wide and have no shared "
                            "expert (--expert-ffn and --shared-ffn are for qwen2moe)\n");
            return 2;
        }
        s->n_ff_exp = s->n_ff;
        s->n_ff_shexp = 0;
        return 0;
    }
    if ((rc = take_dim(f_effn, effn, 1 << 20, &s->n_ff_exp)) ||
        (rc = take_dim(f_sffn, sffn, 1 << 20, &s->n_ff_shexp)))
        return rc;
    if (!s->n_ff_exp) s->n_ff_exp = s->n_ff;
    if (!s->n_ff_shexp) s->n_ff_shexp = s->n_ff;
    return 0;
}

int cli_mkmodel(int argc, char **argv)
{
    const char *out = NULL, *preset = "tiny", *arch = NULL, *type = "f16", *vocab_from = NULL;
    int64_t dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, ctx = 0, seed = 0;
    int64_t experts = 0, experts_used = 0, expert_ffn = 0, shared_ffn = 0;
    double rope_theta = 0;
    cli_flag flags[] = {
        {"out", CLI_FLAG_STR, &out, "output GGUF path (required)", false},
        {"preset", CLI_FLAG_STR, &preset,
         "tiny, llama-134m, llama-1b, llama3-8b; with experts: moe-tiny, qwen2moe-tiny, moe-1b, "
         "mixtral-8x7b, qwen2moe-a2.7b (default tiny)",
         false},
        {"arch", CLI_FLAG_STR, &arch, "llama, qwen2 or qwen2moe (default: the preset's)", false},
        {"dim", CLI_FLAG_INT, &dim, "embedding dimension", false},
        {"layers", CLI_FLAG_INT, &layers, "number of layers", false},
        {"heads", CLI_FLAG_INT, &heads, "attention heads (must divide --dim)", false},
        {"kv-heads", CLI_FLAG_INT, &kv_heads, "KV heads (must divide --heads; default: preset's)",
         false},
        {"ffn", CLI_FLAG_INT, &ffn, "feed-forward dimension", false},
        {"vocab", CLI_FLAG_INT, &vocab, "vocabulary size (with --vocab-from: pad up to N)", false},
        {"ctx", CLI_FLAG_INT, &ctx, "training context length", false},
        {"rope-theta", CLI_FLAG_FLOAT, &rope_theta, "RoPE base frequency", false},
        {"type", CLI_FLAG_STR, &type, "weight type: f32, f16, bf16, q8_0, q4_0 (default f16)",
         false},
        {"vocab-from", CLI_FLAG_STR, &vocab_from, "copy the tokenizer from this GGUF", false},
        {"seed", CLI_FLAG_INT, &seed, "random seed (default 0)", false},
        {"experts", CLI_FLAG_INT, &experts,
         "experts per layer (0 = a dense FFN; default: preset's)", false},
        {"experts-used", CLI_FLAG_INT, &experts_used,
         "experts each token is routed to, top-k (default: preset's, else 2)", false},
        {"expert-ffn", CLI_FLAG_INT, &expert_ffn,
         "qwen2moe: one expert's FFN width (default: preset's, else --ffn)", false},
        {"shared-ffn", CLI_FLAG_INT, &shared_ffn,
         "qwen2moe: the shared expert's FFN width (default: preset's, else --ffn)", false},
    };
    enum {
        F_OUT,
        F_PRESET,
        F_ARCH,
        F_DIM,
        F_LAYERS,
        F_HEADS,
        F_KV,
        F_FFN,
        F_VOCAB,
        F_CTX,
        F_THETA,
        F_TYPE,
        F_VOCAB_FROM,
        F_SEED,
        F_EXPERTS,
        F_EXPERTS_USED,
        F_EXPERT_FFN,
        F_SHARED_FFN
    };
    int rc = cli_flags_parse(flags, (int)TD_ARRAY_LEN(flags), argc, argv, usage_line);
    if (rc == 1) return 0;
    if (rc) return rc;
    if (!out) {
        fprintf(stderr, "error: mkmodel: --out PATH is required\n");
        return 2;
    }

    td_err err;
    td_err_clear(&err);
    td_model_shape s;
    if (td_model_preset(preset, &s, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 2;
    }
    if (arch) {
        if (!strcmp(arch, "llama")) {
            s.arch = TD_ARCH_LLAMA;
            s.rope_type = TD_ROPE_NORM;
        } else if (!strcmp(arch, "qwen2")) {
            s.arch = TD_ARCH_QWEN2;
            s.rope_type = TD_ROPE_NEOX;
        } else if (!strcmp(arch, "qwen2moe")) {
            s.arch = TD_ARCH_QWEN2MOE;
            s.rope_type = TD_ROPE_NEOX;
        } else {
            fprintf(stderr, "error: mkmodel: unknown --arch '%s' (llama, qwen2 or qwen2moe)\n",
                    arch);
            return 2;
        }
    }
    td_type wtype = td_type_parse(type);
    if (wtype != TD_TYPE_F32 && wtype != TD_TYPE_F16 && wtype != TD_TYPE_BF16 &&
        wtype != TD_TYPE_Q8_0 && wtype != TD_TYPE_Q4_0) {
        fprintf(stderr, "error: mkmodel: unknown --type '%s' (f32, f16, bf16, q8_0, q4_0)\n", type);
        return 2;
    }
    if ((rc = take_dim(&flags[F_DIM], dim, 1 << 16, &s.n_embd)) ||
        (rc = take_dim(&flags[F_LAYERS], layers, 1024, &s.n_layer)) ||
        (rc = take_dim(&flags[F_HEADS], heads, 1024, &s.n_head)) ||
        (rc = take_dim(&flags[F_KV], kv_heads, 1024, &s.n_head_kv)) ||
        (rc = take_dim(&flags[F_FFN], ffn, 1 << 20, &s.n_ff)) ||
        (rc = take_dim(&flags[F_VOCAB], vocab, 1 << 24, &s.n_vocab)) ||
        (rc = take_dim(&flags[F_CTX], ctx, 1 << 24, &s.n_ctx_train)) ||
        (rc = take_experts(&flags[F_EXPERTS], experts, &flags[F_EXPERTS_USED], experts_used,
                           &flags[F_EXPERT_FFN], expert_ffn, &flags[F_SHARED_FFN], shared_ffn, &s)))
        return rc;
    if (flags[F_THETA].seen) {
        if (!(rope_theta > 0 && isfinite(rope_theta))) {
            fprintf(stderr, "error: mkmodel: --rope-theta must be positive\n");
            return 2;
        }
        s.rope_theta = (float)rope_theta;
    }
    if (flags[F_SEED].seen && seed < 0) {
        fprintf(stderr, "error: mkmodel: --seed must be >= 0\n");
        return 2;
    }
    if (s.n_embd % s.n_head) {
        fprintf(stderr, "error: mkmodel: --heads %d does not divide --dim %d\n", s.n_head,
                s.n_embd);
        return 2;
    }
    if (!flags[F_KV].seen && s.n_head % s.n_head_kv) s.n_head_kv = s.n_head;
    if (s.n_head % s.n_head_kv) {
        fprintf(stderr, "error: mkmodel: --kv-heads %d does not divide --heads %d\n", s.n_head_kv,
                s.n_head);
        return 2;
    }
    s.head_dim = s.n_embd / s.n_head;
    if (s.head_dim % 2) {
        fprintf(stderr, "error: mkmodel: head dimension %d (--dim / --heads) must be even\n",
                s.head_dim);
        return 2;
    }
    /* With --vocab-from and no --vocab, the vocabulary decides the size. */
    if (vocab_from && !flags[F_VOCAB].seen) s.n_vocab = 0;
    if (td_mkmodel_check(&s, wtype, vocab_from != NULL, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 2;
    }

    double t0 = td_now_s();
    if (td_mkmodel_write(out, &s, wtype, vocab_from, (uint64_t)seed, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    /* Report what was written, read back from the file itself. */
    td_model *m;
    if (td_model_load(&m, out, &err)) {
        fprintf(stderr, "error: mkmodel: wrote '%s' but cannot load it back: %s\n", out, err.msg);
        return 1;
    }
    struct stat st;
    long long file_bytes = stat(out, &st) == 0 ? (long long)st.st_size : -1;
    char experts_note[96] = "";
    if (m->shape.n_expert)
        snprintf(experts_note, sizeof(experts_note), " (%d experts, top-%d: %.3fM active)",
                 m->shape.n_expert, m->shape.n_expert_used,
                 (double)td_model_n_active_params(&m->shape) / 1e6);
    printf("mkmodel: wrote %s: %s %.3fM params%s, vocab %d, %s, %lld bytes, %.1f s\n", out,
           td_arch_name(m->shape.arch), (double)td_model_n_params(&m->shape) / 1e6, experts_note,
           m->shape.n_vocab, td_type_name(m->weight_type), file_bytes, td_now_s() - t0);
    td_model_free(m);
    return 0;
}
