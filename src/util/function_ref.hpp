// A non-owning reference to a callable: what a std::function parameter is, without the heap
// allocation std::function makes for any capture larger than two pointers. The callable must
// outlive the call that receives the reference (true of every lambda passed down the stack).
// The per-call paths take these so that forward, backward and route allocate no host memory.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace moeblaze {
inline namespace v0 {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, FunctionRef>::value>>
  FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): binds like std::function
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace v0
}  // namespace moeblaze
