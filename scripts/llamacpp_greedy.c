/* llama.cpp's greedy continuation of a prompt given as token ids, printed as ids: the quality oracle for models
 * whose answers are not text (synthetic files of random weights write any byte). Built by
 * scripts/llamacpp_fixtures.py against the libllama of edgerun's llama.cpp build.
 *
 *     llamacpp_greedy MODEL THREADS N_PREDICT ID [ID ...]   ->   one line: the N_PREDICT ids chosen
 */
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * data) {
    (void) level; (void) text; (void) data;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL THREADS N_PREDICT ID [ID ...]\n", argv[0]);
        return 2;
    }
    if (getenv("LLAMACPP_GREEDY_LOG") == NULL) llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    int n_prompt = argc - 4, n_predict = atoi(argv[3]);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_predict + 16;
    cp.n_batch = cp.n_ctx;
    cp.n_threads = cp.n_threads_batch = atoi(argv[2]);
    struct llama_context * ctx = llama_init_from_model(model, cp);
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_token * ids = malloc(sizeof(llama_token) * (size_t) n_prompt);
    for (int i = 0; i < n_prompt; i++) {
        ids[i] = atoi(argv[4 + i]);
    }
    struct llama_batch batch = llama_batch_get_one(ids, n_prompt);
    llama_token next;
    for (int step = 0; step < n_predict; step++) {
        if (llama_decode(ctx, batch)) {
            fprintf(stderr, "llama_decode failed at step %d\n", step);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        next = 0;
        for (int t = 1; t < n_vocab; t++) {
            if (logits[t] > logits[next]) {
                next = t;
            }
        }
        printf(step ? " %d" : "%d", next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("\n");
    llama_free(ctx);
    llama_model_free(model);
    free(ids);
    return 0;
}
