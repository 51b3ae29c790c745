// LD_PRELOAD shim for tritonserver (used by scripts/triton_cancel_race.py --count-objects): counts the Triton
// C-API objects that each keep a model loaded (a TRITONSERVER_InferenceRequest and a response factory hold a
// shared_ptr<Model>, and so does every response) as they are made and deleted, and prints, when the process
// exits, how many of each were never deleted with the addresses of the first 20 (tritonserver's verbose log
// names every request by the same address: "prepared: [0x0x...] request id: N").
// The gRPC frontend makes and deletes the requests; the python backend makes and deletes the factories.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#define MAX_LIVE 100000
typedef struct {
  const char* name;
  void** live;
  int n;
  long made, deleted;
} Tally;
static void* req_live[MAX_LIVE];
static void* fac_live[MAX_LIVE];
static void* resp_live[MAX_LIVE];
static Tally requests = {"InferenceRequest", req_live, 0, 0, 0}, factories = {"ResponseFactory", fac_live, 0, 0, 0},
             responses = {"InferenceResponse", resp_live, 0, 0, 0};
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void made(Tally* t, void* p) {
  pthread_mutex_lock(&mu);
  if (t->n < MAX_LIVE) t->live[t->n++] = p;
  t->made++;
  pthread_mutex_unlock(&mu);
}

static void deleted(Tally* t, void* p) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < t->n; i++) {
    if (t->live[i] == p) {
      t->live[i] = t->live[--t->n];
      break;
    }
  }
  t->deleted++;
  pthread_mutex_unlock(&mu);
}

static void report(const Tally* t) {
  fprintf(stderr, "refcount-shim: %s made=%ld deleted=%ld live=%d", t->name, t->made, t->deleted, t->n);
  for (int i = 0; i < t->n && i < 20; i++) fprintf(stderr, " %p", t->live[i]);
  fprintf(stderr, "\n");
}

// runs on exit(), also on tritonserver's exit(1) after its exit timeout; silent in processes that made nothing
__attribute__((destructor)) static void report_all(void) {
  if (requests.made || factories.made) {
    report(&requests);
    report(&factories);
    report(&responses);
  }
}

typedef void* Error;  // TRITONSERVER_Error*
typedef Error (*NewRequestFn)(void**, void*, const char*, int64_t);
typedef Error (*NewFn)(void**, void*);  // made from a request or a factory
typedef Error (*DeleteFn)(void*);
#define REAL(type, name) \
  static type real; \
  if (!real) real = (type)dlsym(RTLD_NEXT, name)

Error TRITONSERVER_InferenceRequestNew(void** request, void* server, const char* model, int64_t version) {
  REAL(NewRequestFn, "TRITONSERVER_InferenceRequestNew");
  Error e = real(request, server, model, version);
  if (!e && *request) made(&requests, *request);
  return e;
}

Error TRITONSERVER_InferenceRequestDelete(void* request) {
  REAL(DeleteFn, "TRITONSERVER_InferenceRequestDelete");
  if (request) deleted(&requests, request);
  return real(request);
}

Error TRITONBACKEND_ResponseFactoryNew(void** factory, void* request) {
  REAL(NewFn, "TRITONBACKEND_ResponseFactoryNew");
  Error e = real(factory, request);
  if (!e && *factory) made(&factories, *factory);
  return e;
}

Error TRITONBACKEND_ResponseFactoryDelete(void* factory) {
  REAL(DeleteFn, "TRITONBACKEND_ResponseFactoryDelete");
  if (factory) deleted(&factories, factory);
  return real(factory);
}

Error TRITONBACKEND_ResponseNewFromFactory(void** response, void* factory) {
  REAL(NewFn, "TRITONBACKEND_ResponseNewFromFactory");
  Error e = real(response, factory);
  if (!e && *response) made(&responses, *response);
  return e;
}

Error TRITONBACKEND_ResponseNew(void** response, void* request) {
  REAL(NewFn, "TRITONBACKEND_ResponseNew");
  Error e = real(response, request);
  if (!e && *response) made(&responses, *response);
  return e;
}

Error TRITONBACKEND_ResponseDelete(void* response) {  // a response the backend drops instead of sending
  REAL(DeleteFn, "TRITONBACKEND_ResponseDelete");
  if (response) deleted(&responses, response);
  return real(response);
}

Error TRITONSERVER_InferenceResponseDelete(void* response) {  // the frontend, once it has the response
  REAL(DeleteFn, "TRITONSERVER_InferenceResponseDelete");
  if (response) deleted(&responses, response);
  return real(response);
}
